"""The gateway's connections send one turn's writes as one: checked on a real socket pair
with the event loop's own transport underneath."""

from __future__ import annotations

import asyncio
import socket

from api_client.gateway.writes import CoalescedWrites


async def _wrapped() -> tuple[CoalescedWrites, socket.socket]:
    """A coalescing transport on one end of a socket pair, and the other end (non-blocking)."""
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return CoalescedWrites(transport, loop), peer  # type: ignore[arg-type]


def _received(peer: socket.socket) -> bytes | None:
    """What the peer can read now: None while nothing came, b"" at the end of the stream."""
    try:
        return peer.recv(65536)
    except BlockingIOError:
        return None


def test_writes_in_one_turn_go_out_together_when_the_turn_ends() -> None:
    async def run() -> None:
        writes, peer = await _wrapped()
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writes.writelines([b"5\r\n", b"hello\r\n"])
        assert writes.get_write_buffer_size() > 0
        assert _received(peer) is None  # held: nothing sent within the turn
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert _received(peer) == b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"
        assert writes.get_write_buffer_size() == 0

        writes.write(b"last")
        writes.close()  # sends what is held before closing
        await asyncio.sleep(0.01)
        assert _received(peer) == b"last"
        assert _received(peer) == b""  # and then the end of the stream
        assert writes.is_closing()
        peer.close()

    asyncio.run(run())


def test_abort_drops_what_is_held_and_a_closed_transport_sends_nothing() -> None:
    async def run() -> None:
        writes, peer = await _wrapped()
        writes.write(b"never sent")
        writes.abort()
        await asyncio.sleep(0.01)
        assert _received(peer) == b""  # the end of the stream, with nothing before it
        peer.close()

        writes, peer = await _wrapped()
        writes.write(b"held")
        writes._transport.close()  # the client left before the turn ended
        await asyncio.sleep(0.01)  # the flush finds the transport closing and skips it
        assert _received(peer) == b""  # the end of the stream, and no "held" before it
        peer.close()

    asyncio.run(run())

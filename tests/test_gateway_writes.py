"""A response's head goes out with its first body part: checked on a real socket pair with
the event loop's own transport underneath, and on a real gateway connection."""

from __future__ import annotations

import asyncio
import socket
import time

from starlette.types import Receive, Scope, Send

from api_client.gateway.writes import HeldHead
from tests.gateway_server import serving


async def _wrapped() -> tuple[HeldHead, socket.socket]:
    """A HeldHead on one end of a socket pair, and the other end (non-blocking)."""
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return HeldHead(transport, loop), peer  # type: ignore[arg-type]


def _received(peer: socket.socket) -> bytes | None:
    """What the peer can read now: None while nothing came, b"" at the end of the stream."""
    try:
        return peer.recv(65536)
    except BlockingIOError:
        return None


def test_the_held_write_goes_out_with_the_next_and_only_it_is_held() -> None:
    async def run() -> None:
        writes, peer = await _wrapped()
        writes.write(b"not held")  # not armed: straight through
        assert _received(peer) == b"not held"

        writes.hold_next()
        writes.write(b"head|")
        assert writes.get_write_buffer_size() >= len(b"head|")
        assert _received(peer) is None  # held
        writes.write(b"first line|")  # sends both at once
        assert _received(peer) == b"head|first line|"
        writes.write(b"second line")  # nothing held any more
        assert _received(peer) == b"second line"
        peer.close()
        writes.close()

    asyncio.run(run())


def test_a_head_alone_goes_out_when_the_turn_ends_or_on_close() -> None:
    async def run() -> None:
        writes, peer = await _wrapped()
        writes.hold_next()
        writes.write(b"head, and the answer waits")
        assert _received(peer) is None
        await asyncio.sleep(0.01)  # the loop's turn ended
        assert _received(peer) == b"head, and the answer waits"

        writes.hold_next()
        writes.write(b"last")
        writes.close()  # sends what is held before closing
        await asyncio.sleep(0.01)
        assert _received(peer) == b"last"
        assert _received(peer) == b""  # and then the end of the stream
        peer.close()

    asyncio.run(run())


def test_abort_drops_what_is_held_and_a_closed_transport_sends_nothing() -> None:
    async def run() -> None:
        writes, peer = await _wrapped()
        writes.hold_next()
        writes.write(b"never sent")
        writes.abort()
        await asyncio.sleep(0.01)
        assert _received(peer) == b""  # the end of the stream, with nothing before it
        peer.close()

        writes, peer = await _wrapped()
        writes.hold_next()
        writes.write(b"held")
        writes._transport.close()  # the client left before the turn ended
        await asyncio.sleep(0.01)  # the flush finds the transport closing and skips it
        assert _received(peer) == b""  # the end of the stream, and no "held" before it
        peer.close()

    asyncio.run(run())


async def _lines(scope: Scope, receive: Receive, send: Send) -> None:
    """An ASGI app: a streamed answer whose first line is sent 0.1 s after its start, in
    the same turn of the loop (a head written at once reaches the client alone), and the
    second later, on every request of a keep-alive connection."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    time.sleep(0.1)  # the loop is held: nothing else runs in between
    await send({"type": "http.response.body", "body": b"one\n", "more_body": True})
    await asyncio.sleep(0.3)
    await send({"type": "http.response.body", "body": b"two\n", "more_body": False})


def test_a_gateway_connection_sends_each_response_head_with_its_first_line() -> None:
    with serving(_lines) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for _ in range(2):  # and again on the same connection
                sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                first = sock.recv(65536)  # the server writes nothing more for 0.3 s
                assert first.startswith(b"HTTP/1.1 200 OK\r\n")
                assert first.endswith(b"\r\n\r\n4\r\none\n\r\n"), first
                rest = b""
                while not rest.endswith(b"0\r\n\r\n"):
                    rest += sock.recv(65536)
                assert rest == b"4\r\ntwo\n\r\n0\r\n\r\n"

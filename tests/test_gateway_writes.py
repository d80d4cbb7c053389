"""A response's head goes out with its first body part: checked on a real socket pair with
the event loop's own transport underneath, and on a real gateway connection."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
import uvloop
from starlette.types import Receive, Scope, Send

from api_client.gateway.writes import HeldHead
from tests.gateway_server import serving

Loop = Callable[[], asyncio.AbstractEventLoop]


def _on(loop: Loop, body: Callable[[HeldHead, socket.socket], Awaitable[None]]) -> None:
    """Run ``body`` on ``loop`` with a HeldHead on one end of a socket pair (the event
    loop's own transport under it) and the other end, non-blocking; both closed after."""

    async def run() -> None:
        ours, peer = socket.socketpair()
        peer.setblocking(False)
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
            asyncio.Protocol, ours
        )
        writes = HeldHead(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        try:
            await body(writes, peer)
        finally:
            writes.close()
            peer.close()

    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(run())


def _received(peer: socket.socket) -> bytes | None:
    """What the peer can read now: None while nothing came, b"" at the end of the stream."""
    try:
        return peer.recv(65536)
    except BlockingIOError:
        return None


# asyncio's own loop and uvloop's (which uvicorn takes when installed, as the gateway does)
LOOPS = pytest.mark.parametrize("loop", [asyncio.new_event_loop, uvloop.new_event_loop])


@LOOPS
def test_the_held_write_goes_out_with_the_next_and_only_it_is_held(loop: Loop) -> None:
    async def body(writes: HeldHead, peer: socket.socket) -> None:
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

    _on(loop, body)


@LOOPS
def test_a_head_alone_goes_out_when_the_turn_ends_or_on_close(loop: Loop) -> None:
    async def body(writes: HeldHead, peer: socket.socket) -> None:
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

    _on(loop, body)


@LOOPS
def test_abort_drops_what_is_held(loop: Loop) -> None:
    async def body(writes: HeldHead, peer: socket.socket) -> None:
        writes.hold_next()
        writes.write(b"never sent")
        writes.abort()
        await asyncio.sleep(0.01)
        assert _received(peer) == b""  # the end of the stream, with nothing before it

    _on(loop, body)


async def _lines(scope: Scope, receive: Receive, send: Send) -> None:
    """An ASGI app: a streamed answer whose first line is sent 0.1 s after its start, in
    the same turn of the loop (a head written at once reaches the client alone), and the
    second 0.1 s later."""
    if scope["type"] != "http":
        return
    await receive()  # the body (for one that expects "100 Continue", uvicorn sends that)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    time.sleep(0.1)  # the loop is held: nothing else runs in between
    await send({"type": "http.response.body", "body": b"one\n", "more_body": True})
    await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": b"two\n", "more_body": False})


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    assert data, "the gateway closed the connection"
    return data


def _read_answers(sock: socket.socket, count: int, buf: bytes = b"") -> None:
    """Read ``count`` answers of :func:`_lines` (after ``buf``, read already), checking
    that each one's head came in the same read as its first line (the server writes that
    line 0.1 s after the head)."""
    for _ in range(count):
        while b"\r\n\r\n" not in buf:
            buf += _recv(sock)
        head, buf = buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
        assert buf.startswith(b"4\r\none\n\r\n"), "the head came without its first line"
        while b"\r\n0\r\n\r\n" not in buf:
            buf += _recv(sock)
        body, buf = buf.split(b"\r\n0\r\n\r\n", 1)
        assert body == b"4\r\none\n\r\n4\r\ntwo\n"
    assert buf == b""


def test_a_gateway_connection_sends_each_response_head_with_its_first_line() -> None:
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    with serving(_lines) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for _ in range(2):  # one after the other on a keep-alive connection
                sock.sendall(request)
                _read_answers(sock, 1)
            sock.sendall(request * 2)  # pipelined: the second answered after the first
            _read_answers(sock, 2)
            sock.sendall(request)
            first = b""
            while b"one" not in first:  # its answer under way (its request's parser gone)
                first += _recv(sock)
            sock.sendall(request[:20])  # the next request, in two parts, as it streams
            sock.sendall(request[20:])
            _read_answers(sock, 2, first)
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n")
            sock.sendall(b"expect: 100-continue\r\n\r\n")
            assert _recv(sock) == b"HTTP/1.1 100 Continue\r\n\r\n"  # not held
            sock.sendall(b"{}")
            _read_answers(sock, 1)  # and the head after it still waits for its first line

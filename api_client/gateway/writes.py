"""The gateway's HTTP connections send a response's head together with its first body part.

uvicorn writes a response's head as soon as the app starts the response, and each body
part as it comes. A streamed answer's head and first line are therefore two writes, two
TCP segments, and two wake-ups of the client: on a machine whose cores are busy decoding,
the first wakes the client, which can take the core before the second is written (up to
3 ms at p90 on the first token's path; bench/README has the numbers). So the head is held
until the first body part, which goes out with it in one write, or until the event loop's
turn ends (a response that starts and waits), whichever comes first. Nothing else is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeldHead(asyncio.Transport):
    """A transport that, once :meth:`hold_next` arms it, holds the next write until the
    write after it (then both go out as one) or the end of the event loop's turn. Every
    other call goes to the transport it wraps; closing sends what is held first, aborting
    drops it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._armed = False
        self._held = b""

    def hold_next(self) -> None:
        self._armed = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._held:  # the head's first body part: both in one write
            data, self._held = self._held + bytes(data), b""
        elif self._armed and bytes(data[:13]) != b"HTTP/1.1 100 ":  # not "100 Continue"
            self._armed = False
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
            return
        self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        data, self._held = self._held, b""
        if data:  # a transport closed meanwhile drops it (nobody is left to read it)
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = b""
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class _Pipeline(list[Any]):
    """uvicorn's queue of pipelined requests (``appendleft``, ``pop``) as a list: a deque
    costs 760 bytes even empty, a list 56, and nearly every connection's stays empty."""

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


def _lean(event: asyncio.Event) -> None:
    """An asyncio.Event whose waiters (append, remove, iterate: all it does with them) are
    a list: uvicorn makes two events a connection, and an empty deque costs 760 bytes."""
    if not event._waiters:
        event._waiters = []  # type: ignore[assignment]


# a request's scope: callbacks for when its client goes away (None once it has gone)
ON_GONE = "ggufq.on_gone"
# what every connection or request has alike, kept once: a listening address, the scope's
# "asgi" dict of an ASGI version
_SHARED: dict[Any, Any] = {}


def _parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    """A request parser for ``protocol``, as uvicorn makes one."""
    parser = httptools.HttpRequestParser(protocol)
    with contextlib.suppress(AttributeError):  # httptools < 0.6.3
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose responses' heads wait for their first body part
    (:class:`HeldHead`), and which calls a request's :data:`ON_GONE` callbacks when its
    connection is lost before its response is complete: a waiting answer learns that its
    client left without a task of its own reading for the disconnect (thousands wait).
    What every connection has alike is kept once, and a connection between two requests
    holds no parser."""

    transport: HeldHead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        self.reading = False  # a request's bytes are under way: its parser holds its state

    def data_received(self, data: bytes) -> None:
        # The parser (with its nine bound callbacks, about 1 KB) is let go once a request
        # has come whole and its answer is under way, and made again when the client sends
        # more: a gateway holds thousands of answers waiting, their clients sending nothing.
        if self.parser is None:
            self.parser = _parser(self)
        super().data_received(data)
        cycle = self.cycle
        if not self.reading and cycle is not None and cycle.keep_alive and self.parser is not None:
            # between two requests of a keep-alive connection a new parser is the same
            # (after a request that closes it, the old one ignores what comes: kept)
            self.parser = None  # type: ignore[assignment]

    def on_message_begin(self) -> None:
        self.reading = True
        super().on_message_begin()
        asgi = self.scope["asgi"]  # the same for every request: not a dict each
        self.scope["asgi"] = _SHARED.setdefault(("asgi", asgi["version"]), asgi)

    def on_message_complete(self) -> None:
        self.reading = False
        super().on_message_complete()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeldHead(transport, asyncio.get_running_loop()))
        _lean(self.flow._is_writable_event)
        # the addresses every connection has alike, shared: the listening one, a client's host
        self.server = _SHARED.setdefault(self.server, self.server)
        if self.client is not None:
            self.client = (sys.intern(self.client[0]), self.client[1])

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # a request begins to be answered (a pipelined one too, once the one before it is
        # complete): its response's head is the next thing written. uvicorn's own hook,
        # private: tests/test_gateway_writes.py fails if a head goes out alone.
        self.transport.hold_next()
        _lean(cycle.message_event)
        cycle.scope[ON_GONE] = []
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            callbacks: list[Callable[[], None]] = cycle.scope.get(ON_GONE) or []  # type: ignore[assignment]
            # gone for good: an answer that registers later (its endpoint was still
            # submitting) finds no list, and reads receive(), which says so at once
            cycle.scope[ON_GONE] = None  # type: ignore[literal-required]
            for callback in callbacks:
                callback()

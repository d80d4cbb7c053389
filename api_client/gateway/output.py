"""A waiting answer's output: its sends, one at a time, and what goes out while it waits.

A gateway holds thousands of waiting answers. Each has an :class:`Output` (its sends, its
head's Server-Timing, when it last sent), and one task for all of an event loop's answers
(:class:`KeepAlives`) sends each its keep-alive bytes after a quiet spell, or its model's
load progress (:mod:`api_client.gateway.loads`) as soon as that moves, in the shape each
API's clients skip or read (Ollama's ``load_progress`` field, an SSE comment).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Send

from api_client.gateway.loads import LoadBoard, LoadProgress

log = logging.getLogger(__name__)
Beat = Callable[[LoadProgress | None], bytes]  # a keep-alive frame, with a load's progress


@dataclass(slots=True)
class LoadFeed:
    """What a waiting answer shows of its model's load, and what it showed last."""

    board: LoadBoard
    model: str
    shown: LoadProgress | None = None
    version: int = -1  # of the board, when this answer last looked
    watching: bool = False

    def start(self) -> None:
        self.watching = True
        self.board.watch()

    def stop(self) -> None:
        """Its answer has its first chunk, or ended: it shows no more progress."""
        if self.watching:
            self.watching = False
            self.board.unwatch()


@dataclass(slots=True)
class ServerTiming:
    """A streamed answer's Server-Timing header: ``gateway``, the gateway's own time before
    the first byte (from the request's arrival until its job was made, and from the job's
    first chunk until the answer began), and ``cluster``, the time between (the job sent,
    placed and run to its first chunk). A keep-alive that begins the answer before any
    chunk leaves the second part of ``gateway`` out and ends ``cluster`` there (it says
    so in its ``desc``). Wall clock, in milliseconds."""

    arrived: float | None  # the request's arrival (the app's Guard notes it)
    made: float  # the job's submitted_at
    first_chunk: float | None = None

    def header(self, now: float) -> tuple[bytes, bytes]:
        first = now if self.first_chunk is None else self.first_chunk
        own = (now - first) + (0.0 if self.arrived is None else self.made - self.arrived)
        cluster = f"cluster;dur={_ms(first - self.made)}"
        if self.first_chunk is None:
            cluster += ';desc="until a keep-alive"'
        return b"server-timing", f"gateway;dur={_ms(own)}, {cluster}".encode()


def _ms(seconds: float) -> str:
    return f"{max(0.0, seconds) * 1000:.3f}"  # a wall clock stepped back: 0, not negative


def sse_beat(keepalive: bytes) -> Beat:
    """An SSE API's beat: its keep-alive, or the load's progress as a comment (which
    every SSE client skips, and a person reading the stream sees)."""

    def beat(progress: LoadProgress | None) -> bytes:
        if progress is None:
            return keepalive
        return b": load_progress " + json.dumps(progress.body()).encode() + b"\n\n"

    return beat


class Output:
    """The response's sends, one at a time (the reading task and the keep-alives both
    send), and when the last one went out."""

    __slots__ = (
        "send",
        "head",
        "timing",
        "beat",
        "every_s",
        "feed",
        "started",
        "ended",
        "lock",
        "loop",
        "last",
        "reading",
        "gone",
    )  # one a waiting answer: no dict each

    def __init__(
        self,
        send: Send,
        head: list[tuple[bytes, bytes]],
        beat: Beat,
        every_s: float,
        timing: ServerTiming,
        feed: LoadFeed | None = None,
    ):
        self.send, self.head, self.timing = send, head, timing
        self.beat, self.every_s, self.feed = beat, every_s, feed
        self.started = self.ended = False
        self.lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.reading = asyncio.current_task()  # the task that reads the job's stream
        self.gone = False  # its client left before the response was complete

    def left(self) -> None:
        """The client went away before the response ended: stop reading (the job is cancelled)."""
        if not self.ended and self.reading is not None:
            self.gone = True
            self.reading.cancel()

    async def frames(self, frames: list[bytes], more: bool = True) -> None:
        async with self.lock:
            if self.ended:  # a keep-alive due as the job's stream closes
                return
            if not self.started:
                self.started = True
                headers = [*self.head, self.timing.header(time.time())]
                await self.send({"type": "http.response.start", "status": 200, "headers": headers})
            for frame in frames:
                await self.send({"type": "http.response.body", "body": frame, "more_body": True})
            if not more:
                self.ended = True
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            self.last = self.loop.time()

    def quiet_for(self, now: float) -> float:
        return 0.0 if self.ended or self.lock.locked() else now - self.last

    def due(self, now: float) -> bytes | None:
        """The frame due now, if any: the load's progress when it moved (its job has
        sent nothing yet), else a keep-alive after ``every_s`` of quiet."""
        feed = self.feed if self.timing.first_chunk is None and not self.ended else None
        if feed is not None and feed.version != feed.board.version:
            if self.lock.locked():
                return None  # a send is under way: look again at the next tick
            feed.version = feed.board.version
            known = feed.board.known(feed.model)
            if known is not None and (feed.shown is None or known.shown() != feed.shown.shown()):
                feed.shown = known
                return self.beat(known)
        if self.quiet_for(now) < self.every_s:
            return None
        return self.beat(None if feed is None else feed.board.known(feed.model))


class KeepAlives:
    """The waiting responses of one event loop, and one task that sends each its keep-alive
    bytes once nothing went out for its ``every_s``: a task (and a timer) per waiting
    client cost more than the clients themselves, and a gateway holds thousands."""

    LOOK_S = 0.25

    def __init__(self) -> None:
        self._outputs: set[Output] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, out: Output) -> None:
        self._outputs.add(out)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="ggufq-keepalives")

    def discard(self, out: Output) -> None:
        self._outputs.discard(out)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._outputs:
            await asyncio.sleep(self.LOOK_S)
            now = loop.time()
            for out in list(self._outputs):
                try:
                    frame = out.due(now)
                except Exception:  # one response's fault must not stop everyone's
                    log.exception("a waiting response's keep-alive failed")
                    self._outputs.discard(out)
                    continue
                if frame is None:
                    continue
                out.last = now  # not again before its send went out
                # a task of its own: a client that reads slowly holds up no other
                task = loop.create_task(out.frames([frame]))
                task.add_done_callback(_ignore)


def _ignore(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # a send to a client gone: its reading task ends the response


_keepalives: dict[asyncio.AbstractEventLoop, KeepAlives] = {}


def keepalives() -> KeepAlives:
    """The keep-alive sender of the running event loop."""
    loop = asyncio.get_running_loop()
    found = _keepalives.get(loop)
    if found is None:
        for old in [other for other in _keepalives if other.is_closed()]:
            del _keepalives[old]
        found = _keepalives[loop] = KeepAlives()
    return found

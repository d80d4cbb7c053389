"""A job's chunks as an HTTP response: waited for with keep-alive bytes, cancelled when the
client goes away.

The response reads the job's stream in its own task, so a chunk goes from Redis to the
socket without crossing a queue or another task (each crossing costs a wake-up on the
first token's path). One small task stands beside it, which, when the client goes away,
cancels the reading task, and so the job; keep-alive bytes after a quiet spell (which begin
the response, 200, if the job has sent nothing yet) come from one task for all the
responses of the process (:class:`KeepAlives`).

While the job waits for its model's load, the keep-alives carry the load's progress
(:mod:`api_client.gateway.loads`): a line as soon as the progress moves, in the shape
each API's clients skip or read (Ollama's ``load_progress`` field, an SSE comment).

An error before anything was sent is raised, so that the app answers it with its status
(404, 503 with Retry-After ...); after that it goes in-stream, as each API does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api_client.ajob import AsyncJob
from api_client.gateway.loads import LoadBoard, LoadProgress
from api_client.gateway.resume import StreamIds, opened
from api_client.gateway.writes import ON_GONE
from scheduler.errors import GgufqError, JobFailed, RedisUnavailable
from scheduler.protocol import GenerateResponse

log = logging.getLogger(__name__)
SSE_TYPE = "text/event-stream"
Encode = Callable[[GenerateResponse], list[bytes]]
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


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (its request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def or_cancel_on_disconnect(request: Request, work: Awaitable[Any], job: AsyncJob) -> Any:
    """Await ``work`` for a non-streamed answer; a client that leaves first cancels the job."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.shield(job.cancel())
        raise asyncio.CancelledError  # nobody is left to answer
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


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


class _Output:
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
        self._outputs: set[_Output] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, out: _Output) -> None:
        self._outputs.add(out)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="ggufq-keepalives")

    def discard(self, out: _Output) -> None:
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


@lru_cache(maxsize=64)
def _header(name: str, value: str) -> tuple[bytes, bytes]:
    """A constant header as a response's raw headers hold it, made once."""
    return name.lower().encode("latin-1"), value.encode("latin-1")


def _content_type(media_type: str) -> str:
    """``media_type`` as Starlette sends it: text types with their charset."""
    if media_type.startswith("text/") and "charset=" not in media_type.lower():
        return media_type + "; charset=utf-8"
    return media_type


class JobStreamResponse(Response):
    """A job's chunks, each encoded by ``encode``; a ``beat`` after ``keepalive_s``
    without one, or when its model's load moved (``loads``); the job's error encoded by
    ``encode_error`` once the response has begun."""

    def __init__(
        self,
        job: AsyncJob,
        encode: Encode,
        encode_error: Callable[[GgufqError], bytes],
        beat: Beat,
        keepalive_s: float,
        timeout_s: float,
        media_type: str,
        headers: dict[str, str],
        job_header: str,
        loads: LoadBoard | None = None,
    ) -> None:
        self.job, self.encode, self.encode_error = job, encode, encode_error
        self.beat, self.keepalive_s, self.timeout_s = beat, keepalive_s, timeout_s
        self.loads = loads
        self.ids: StreamIds | None = None  # a resumable stream's (resume.py), as it begins
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        # a gateway holds thousands of these: the constant ``headers``' bytes are shared;
        # ``job_header`` names the job, its own
        self.raw_headers = [
            *(_header(k, v) for k, v in headers.items()),
            (job_header.lower().encode("latin-1"), job.id.encode("latin-1")),
            _header("content-type", _content_type(media_type)),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        resumable = await opened(scope, self.job, self.media_type == SSE_TYPE)
        self.ids = None if resumable is None else resumable[0]
        named = [(b"x-conversation-id", resumable[1].encode())] if resumable else []
        head = self.raw_headers + named if named else self.raw_headers  # a message once sent
        timing = ServerTiming(scope.get("state", {}).get("arrived"), self.job.submitted_at)
        feed = None if self.loads is None else LoadFeed(self.loads, self.job.model)
        out = _Output(send, head, self.beat, self.keepalive_s, timing, feed)
        left = out.left
        helpers = []
        on_gone = scope.get(ON_GONE)
        if on_gone is not None:  # the gateway's own server says when the client leaves
            on_gone.append(left)
        else:  # any other ASGI server: a task reads for the disconnect
            watch = _watch(receive, left)
            helpers.append(asyncio.create_task(watch, name=f"watch-{self.job.id}"))
        sender = keepalives()
        sender.add(out)
        if feed is not None:
            feed.start()  # stopped in the finally below
        # a resumable stream's client gone leaves its job for another reader to pick up
        stream = self.job.stream(self.timeout_s, lapse_on_close=self.ids is not None)
        chunks = cast(AsyncGenerator[GenerateResponse, None], stream)
        try:
            error = await self._relay(chunks, out)
            if error is not None and not out.started:
                raise error  # the app answers it with its status
            if not out.ended:
                await out.frames([self.encode_error(error)] if error else [], more=False)
        except asyncio.CancelledError:
            if not out.gone or out.reading is None:
                raise
            out.reading.uncancel()  # the client left: not an error, and nobody to answer
        finally:
            if on_gone is not None:  # before any await: nothing may cancel what follows
                with contextlib.suppress(ValueError):
                    on_gone.remove(left)
            sender.discard(out)
            if feed is not None:
                feed.stop()
            for helper in helpers:  # before any await: it can cancel nothing after
                helper.cancel()
            await chunks.aclose()  # cancels the job unless it had ended

    async def _relay(
        self, chunks: AsyncGenerator[GenerateResponse, None], out: _Output
    ) -> GgufqError | None:
        """Send every chunk; the error the job's stream ended with, if any."""
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return None
            except RedisUnavailable as exc:  # the job was made: not a "try again" (503)
                return self._lost(exc)
            except GgufqError as exc:
                return exc
            except Exception as exc:  # Redis gone mid-stream: an error the caller can read
                return self._lost(exc)
            if out.timing.first_chunk is None:
                out.timing.first_chunk = time.time()
                if out.feed is not None:
                    out.feed.stop()
            frames = self.encode(chunk)
            if self.ids is not None:  # a resumable stream: ids, and only the chunks asked for
                frames = self.ids.frames(frames, chunk.seq)
            await out.frames(frames, more=not self.job.ends_with(chunk))

    def _lost(self, exc: Exception) -> JobFailed:
        return lost(self.job.id, "stream", exc)


async def _watch(receive: Receive, left: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    left()


def lost(job_id: str, what: str, exc: Exception) -> JobFailed:
    """The error of a job whose stream or result the gateway could no longer read: Redis
    went away after the job was made (the job is cancelled once Redis answers). A JobFailed
    (500), not the 503 of Redis being away before the job was made."""
    return JobFailed(
        f"the gateway lost job {job_id}'s {what} ({type(exc).__name__}): Redis stopped "
        "answering; the job is cancelled once it answers again; check that Redis is "
        "reachable from the gateway, then retry"
    )

"""A job's chunks as an HTTP response: waited for with keep-alive bytes, cancelled when the
client goes away.

The response reads the job's stream in its own task, so a chunk goes from Redis to the
socket without crossing a queue or another task (each crossing costs a wake-up on the
first token's path). When the client goes away, the gateway's server (or, under another
ASGI server, one small task beside it) cancels the reading task, and so the job. What goes
out while the job waits (keep-alives, its model's load progress) comes from one task for
all the responses of the process (:mod:`api_client.gateway.output`).

An error before anything was sent is raised, so that the app answers it with its status
(404, 503 with Retry-After ...); after that it goes in-stream, as each API does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api_client.ajob import AsyncJob
from api_client.gateway.loads import LoadBoard
from api_client.gateway.output import Beat, LoadFeed, Output, ServerTiming, keepalives
from api_client.gateway.resume import StreamIds, opened
from api_client.gateway.writes import ON_GONE
from scheduler.errors import GgufqError, JobFailed, RedisUnavailable
from scheduler.protocol import GenerateResponse

log = logging.getLogger(__name__)
SSE_TYPE = "text/event-stream"
Encode = Callable[[GenerateResponse], list[bytes]]


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
        _forget_headers(scope)
        self.ids = None if resumable is None else resumable[0]
        named = [(b"x-conversation-id", resumable[1].encode())] if resumable else []
        head = self.raw_headers + named if named else self.raw_headers  # a message once sent
        timing = ServerTiming(scope.get("state", {}).get("arrived"), self.job.submitted_at)
        feed = None if self.loads is None else LoadFeed(self.loads, self.job.model)
        out = Output(send, head, self.beat, self.keepalive_s, timing, feed)
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
        chunks = self.job.reader(self.timeout_s, lapse_on_close=self.ids is not None)
        try:
            # the relay, here and not in a coroutine of its own: one frame less on the
            # stack of every waiting answer
            error: GgufqError | None = None
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    error = self._error_of(exc)
                    break
                await out.frames(self._frames(chunk, out), more=not self.job.ends_with(chunk))
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

    def _error_of(self, exc: Exception) -> GgufqError:
        """The error the job's stream ended with: its own, or that Redis was lost (the job
        was made: not the "try again" of RedisUnavailable, 503), an error the caller can
        read."""
        if isinstance(exc, GgufqError) and not isinstance(exc, RedisUnavailable):
            return exc
        return self._lost(exc)

    def _frames(self, chunk: GenerateResponse, out: Output) -> list[bytes]:
        """What goes out for ``chunk``."""
        if out.timing.first_chunk is None:
            out.timing.first_chunk = time.time()
            if out.feed is not None:
                out.feed.stop()
        frames = self.encode(chunk)
        if self.ids is not None:  # a resumable stream: ids, and only the chunks asked for
            frames = self.ids.frames(frames, chunk.seq)
        return frames

    def _lost(self, exc: Exception) -> JobFailed:
        return lost(self.job.id, "stream", exc)


def _forget_headers(scope: Scope) -> None:
    """Let go of the request's headers, all read by now (the Guard, the endpoint, and
    :func:`opened`): thousands of answers wait, and a client sends a dozen headers."""
    headers = scope.get("headers")
    if isinstance(headers, list):  # the server's own list, which it holds too
        headers.clear()


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

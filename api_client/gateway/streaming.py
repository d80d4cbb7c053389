"""A job's chunks as an HTTP response: waited for with keep-alive bytes, cancelled when the
client goes away.

The job's reader runs in a task that pumps chunks into a queue, so that the response can
wait for the next one with a deadline (and send keep-alive bytes meanwhile) without ever
cancelling the reader itself, which would cancel the job. Closing the feed (the response
ended, or the client disconnected) cancels the reader, and so the job unless it had ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api_client.aio import AsyncJob
from scheduler.errors import GgufqError, JobFailed
from scheduler.protocol import GenerateResponse

Item = GenerateResponse | GgufqError


class JobFeed:
    """The chunks of one job, the last with the stats, or the error it ended with."""

    def __init__(self, job: AsyncJob, timeout_s: float) -> None:
        self.job = job
        self.timeout_s = timeout_s
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.ended = False
        self.task = asyncio.create_task(self._pump(), name=f"feed-{job.id}")

    async def _pump(self) -> None:
        try:
            async for chunk in self.job.stream(timeout=self.timeout_s):
                self.queue.put_nowait(chunk)
        except GgufqError as exc:
            self.queue.put_nowait(exc)
        except Exception as exc:  # Redis gone mid-stream: an error the caller can read
            self.queue.put_nowait(
                JobFailed(
                    f"the gateway lost job {self.job.id}'s stream ({type(exc).__name__}: {exc}); "
                    "check that Redis is reachable from the gateway, then retry"
                )
            )

    async def next(self, wait_s: float) -> Item:
        """The next chunk or error; TimeoutError when none came within ``wait_s``."""
        async with asyncio.timeout(wait_s):  # not wait_for: no task per chunk
            item = await self.queue.get()
        if isinstance(item, GgufqError) or item.done:
            self.ended = True
        return item

    async def close(self) -> None:
        """Stop reading; the job is cancelled unless it had ended."""
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


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


Encode = Callable[[GenerateResponse], list[bytes]]


async def frames(
    feed: JobFeed,
    first: Item | None,
    encode: Encode,
    encode_error: Callable[[GgufqError], bytes],
    keepalive: bytes,
    keepalive_s: float,
) -> AsyncIterator[bytes]:
    """The response body: each chunk encoded, keep-alive bytes while none comes, and an
    error in-stream when the job fails after the response has begun."""
    item: Item | None = first
    try:
        while True:
            if item is None:
                try:
                    item = await feed.next(keepalive_s)
                except TimeoutError:
                    yield keepalive
                    continue
            if isinstance(item, GgufqError):
                yield encode_error(item)
                return
            for frame in encode(item):
                yield frame
            if item.done:
                return
            item = None
    finally:
        await feed.close()


async def first_item(feed: JobFeed, wait_s: float) -> Item | None:
    """The job's first chunk if it comes within ``wait_s`` (None: it is waiting). An error
    before anything was sent is raised, so that it becomes the response's status."""
    try:
        item = await feed.next(wait_s)
    except TimeoutError:
        return None
    except BaseException:
        await feed.close()
        raise
    if isinstance(item, GgufqError):
        await feed.close()
        raise item
    return item


class JobStreamResponse(Response):
    """A job's frames as the response body, on asyncio alone: a client that disconnects
    (or a send that fails) closes the body, which cancels the job through the feed's close.

    Starlette's StreamingResponse watches for the disconnect from an anyio task group,
    whose set-up lies on the first token's path (a tenth of a millisecond and more on a
    CPU that idled while the job was placed); here the watcher is one plain task.
    """

    def __init__(
        self, body: AsyncIterator[bytes], media_type: str, headers: dict[str, str]
    ) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if streaming is not None:
                streaming.cancel()

        watcher = asyncio.create_task(watch(), name="disconnect-watch")
        try:
            await self._send_all(send)
        except asyncio.CancelledError:
            if not gone.is_set() or streaming is None:
                raise
            streaming.uncancel()  # the client left: not an error, nobody to answer
        finally:
            watcher.cancel()  # before any await: it cannot cancel us after this
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _send_all(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for frame in self.body_iterator:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

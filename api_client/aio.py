"""The asyncio client: ``AsyncClient`` mirrors ``Client`` method for method.

Chunks come through redis.asyncio (subscribe, backfill from the job's stream, follow), and
a result is awaited on its Celery result channel, so a thousand waiting jobs hold no
thread. Celery's own calls (sending a job, decoding a stored result) are short and run in
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, overload

from api_client.ajob import AsyncJob
from api_client.batch import BatchStopped, run_batch
from api_client.batch_files import BatchInput, BatchSummary
from api_client.client import Client, Messages
from api_client.job import Job
from scheduler.cluster import DeviceView, JobView, RunnerView, by_expiry
from scheduler.protocol import EmbedResponse, GenerateResponse, JobRequest, Options
from scheduler.settings import Settings
from scheduler.store.chunk_reading import AsyncChunkSources
from scheduler.store.connection import connect_typed_async
from scheduler.store.headroom import LOOK_FROM_BYTES, admit, refused_for_memory
from scheduler.store.hub import Hub
from scheduler.store.leases import Leases
from scheduler.store.readers import aread_runners
from scheduler.store.routes import AsyncFastPath

SIDE_TIMEOUT_S = 5.0


class AsyncClient:
    """``Client`` for asyncio: ``async with AsyncClient() as client: ...``.

    Every method of ``Client`` is a coroutine here. Streaming follows Ollama's AsyncClient:
    ``async for chunk in await client.generate(..., stream=True)``; a submitted job streams
    with ``async for chunk in job.stream()``.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        timeout: float = 300.0,
        settings: Settings | None = None,
        max_connections: int | None = None,
    ) -> None:
        # max_connections: Redis connections of each of its two pools, asyncio and the
        # threads' (besides its one pub/sub connection); None: as many as calls at once
        self.sync = Client(
            redis_url, timeout=timeout, settings=settings, max_connections=max_connections
        )
        try:
            self.sync.streams.check()  # BadSettings when placement serves other instances
        except BaseException:
            self.sync.close()
            raise
        self.redis_url = self.sync.redis_url
        self.settings = self.sync.settings
        self.timeout = timeout
        self.r = connect_typed_async(self.redis_url, max_connections)
        # Celery's sends, in one thread: Celery keeps its producer, its event dispatcher and
        # their connections per thread, so every thread that sends would hold its own
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufq-send")
        # connections of their own for what must never wait behind the pool's: one pub/sub
        # connection for all this client's waits, and one for its readers' leases
        # (their commands are short: a connection that stops answering is given up on well
        # within a lease's life, so that one half-open socket cannot let every lease lapse)
        self.side = connect_typed_async(self.redis_url, socket_timeout=SIDE_TIMEOUT_S)
        self.hub = Hub(self.side)
        # each job's stream: on this Redis, or on one of GGUFQ_STREAM_REDIS_URLS
        urls = self.settings.stream_redis_urls
        self.streams = AsyncChunkSources(self.r, self.hub, urls, SIDE_TIMEOUT_S, max_connections)
        self.leases = Leases(self.side)  # its streaming readers' leases, renewed together
        fast = self.sync.fast
        self.fast = (
            None
            if fast is None
            else AsyncFastPath(self.r, fast.device_ttl_s, fast.claim_ttl_s, fast.stream_ttl_s)
        )

    async def close(self) -> None:
        self._sender.shutdown(wait=False)
        await self.leases.aclose()
        await self.streams.aclose()
        await self.hub.aclose()
        await self.side.aclose()
        await self.r.aclose()
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- jobs -------------------------------------------------------------------------------
    async def submit(
        self,
        model: str,
        prompt: str = "",
        *,
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        priority: Literal["interactive", "batch"] = "interactive",
        device: str | None = None,
        format: Literal["json"] | dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        **fields: Any,
    ) -> AsyncJob:
        """Submit a job; returns its handle once sent (see :meth:`Client.submit`). A job
        for a resident runner with a free slot goes on the fast path from this event loop;
        the normal path's sending (Celery's) runs in a thread."""
        sync = self.sync
        request = sync.request(
            model,
            prompt,
            options=options,
            keep_alive=keep_alive,
            priority=priority,
            device=device,
            format=format,
            extra=extra,
            **fields,
        )
        with refused_for_memory():
            if request.chars >= LOOK_FROM_BYTES:  # a round trip: in a thread
                await asyncio.to_thread(admit, sync.r, request.chars)
            if not (self.fast is not None and await self._send_fast(request)):
                await self._send_to_placement(request)
        return AsyncJob(self, Job(sync, request))

    def attach(self, model: str, prompt: str = "", **kwargs: Any) -> AsyncJob:
        """The handle of a job submitted before with these very arguments (its ``id`` and
        ``submitted_at`` among them), not sent again: whoever takes over from the process
        that sent it waits for that job, which its reader sends again only if it was lost
        (placement places a job once)."""
        return AsyncJob(self, Job(self.sync, self.sync.request(model, prompt, **kwargs)))

    async def _send_fast(self, request: JobRequest) -> bool:
        assert self.fast is not None
        return await self.fast.send(request, *self.sync.fast_parts(request)) is not None

    async def _send_to_placement(self, request: JobRequest) -> None:
        """Celery's sending, in a thread; a caller that leaves meanwhile (the awaiting task
        cancelled) lets it finish, then cancels the job it sent, which nobody would read."""
        loop = asyncio.get_running_loop()
        sending = loop.run_in_executor(self._sender, self.sync.send_to_placement, request)
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await sending  # not sent (an error): nothing to cancel
                await asyncio.to_thread(self.sync.cancel, request.id)
            raise

    @overload
    async def generate(
        self, model: str, prompt: str, *, stream: Literal[False] = False, **kw: Any
    ) -> GenerateResponse: ...

    @overload
    async def generate(
        self, model: str, prompt: str, *, stream: Literal[True], **kw: Any
    ) -> AsyncIterator[GenerateResponse]: ...

    async def generate(
        self, model: str, prompt: str, *, stream: bool = False, **kw: Any
    ) -> GenerateResponse | AsyncIterator[GenerateResponse]:
        """A completion; with ``stream=True``, an async iterator of chunks (the job is
        already submitted when the await returns)."""
        job = await self.submit(model, prompt, **kw)
        return job.stream() if stream else await job.result()

    @overload
    async def chat(
        self, model: str, messages: Messages, *, stream: Literal[False] = False, **kw: Any
    ) -> GenerateResponse: ...

    @overload
    async def chat(
        self, model: str, messages: Messages, *, stream: Literal[True], **kw: Any
    ) -> AsyncIterator[GenerateResponse]: ...

    async def chat(
        self, model: str, messages: Messages, *, stream: bool = False, **kw: Any
    ) -> GenerateResponse | AsyncIterator[GenerateResponse]:
        """Answer a conversation (see :meth:`Client.chat`)."""
        job = await self.submit(model, extra={"kind": "chat", "messages": list(messages)}, **kw)
        return job.stream() if stream else await job.result()

    async def embed(
        self,
        model: str,
        input: str | list[str],
        *,
        truncate: bool = False,
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        timeout: float | None = None,
    ) -> EmbedResponse:
        """One L2-normalized vector per input (see :meth:`Client.embed`)."""
        job = await self.submit(
            model,
            options=options,
            keep_alive=keep_alive,
            extra={"kind": "embed", "input": input, "truncate": truncate},
        )
        return EmbedResponse.model_validate(await job.final(timeout))

    async def load(
        self,
        model: str,
        *,
        device: str | None = None,
        keep_alive: str | float | None = None,
        options: Options | dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResponse:
        """Load a model ahead of use; returns once it is loaded."""
        job = await self.submit(model, "", options=options, keep_alive=keep_alive, device=device)
        return await job.result(timeout)

    async def unload(self, model: str) -> list[str]:
        """Unload every runner of ``model``; the ids of the runners asked to unload."""
        return await asyncio.to_thread(self.sync.unload, model)

    async def cancel(self, job_id: str) -> None:
        await asyncio.to_thread(self.sync.cancel, job_id)

    async def batch(
        self,
        model: str,
        inputs: BatchInput,
        *,
        output: str | Path | None = None,
        concurrency: int = 8,
        priority: Literal["interactive", "batch"] = "batch",
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        resume: bool = False,
        retries: int = 2,
        on_progress: Callable[[BatchSummary], object] | None = None,
    ) -> BatchSummary:
        """:meth:`Client.batch` in a thread (``on_progress`` is called from it).

        Cancelling the awaiting task stops the batch as Ctrl-C does: the jobs in flight
        are cancelled and the rows written so far stay, for ``resume=True``.
        """
        stop = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(
                run_batch,
                self.sync,
                model,
                inputs,
                output=output,
                concurrency=concurrency,
                priority=priority,
                options=options,
                keep_alive=keep_alive,
                resume=resume,
                retries=retries,
                on_progress=on_progress,
                stop=stop,
            )
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(BatchStopped):
                await work
            raise

    # -- state ------------------------------------------------------------------------------
    async def jobs(self) -> list[JobView]:
        return await asyncio.to_thread(self.sync.jobs)

    async def devices(self) -> list[DeviceView]:
        return await asyncio.to_thread(self.sync.devices)

    async def ps(self) -> list[RunnerView]:
        """:meth:`Client.ps`, on this client's asyncio connections."""
        return by_expiry(await aread_runners(self.r))

    async def models(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.models)

    async def health(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.health)

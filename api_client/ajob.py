"""A submitted job awaited from asyncio (:class:`AsyncJob`, made by ``AsyncClient``): its
chunks through the client's shared pub/sub connection, its result decoded from its stored
record, its reader's lease renewed with every other reader's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

import redis
import redis.asyncio

from api_client.client import Client
from api_client.job import CHECK_EVERY_S, Job
from api_client.results import StreamEnds, result_key, result_ready, stored
from scheduler.errors import JobTimeout, error_from_code
from scheduler.protocol import GenerateResponse, JobRequest
from scheduler.settings import Settings
from scheduler.store.cancel import ReaderLease
from scheduler.store.chunk_reading import AsyncChunkSources, ChunkFollower
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.hub import QUIET_S, Hub
from scheduler.store.leases import Leases

log = logging.getLogger(__name__)


class AsyncHost(Protocol):
    """What an :class:`AsyncJob` needs of its client (``AsyncClient`` is one)."""

    r: redis.asyncio.Redis
    hub: Hub
    streams: AsyncChunkSources  # each job's stream's Redis, and a hub there
    leases: Leases
    settings: Settings
    sync: Client
    timeout: float

    async def cancel(self, job_id: str) -> None: ...


class Reader(Protocol):
    """What :meth:`AsyncJob.reader` gives: chunks, and ``aclose()`` once done with them."""

    def __aiter__(self) -> AsyncIterator[GenerateResponse]: ...

    def __anext__(self) -> Awaitable[GenerateResponse]: ...

    def aclose(self) -> Awaitable[None]: ...


class AsyncJob:
    """A submitted job, awaited from asyncio; the same id as everywhere else."""

    __slots__ = ("client", "job", "id", "model", "submitted_at")  # one a waiting answer

    def __init__(self, client: AsyncHost, job: Job) -> None:
        self.client = client
        self.job = job
        self.id, self.model, self.submitted_at = job.id, job.model, job.submitted_at

    @property
    def request(self) -> JobRequest:
        """The job as submitted."""
        return self.job.request

    def __repr__(self) -> str:
        return f"AsyncJob(id={self.id!r}, model={self.model!r})"

    async def hops(self) -> dict[str, float]:
        """See :meth:`Job.hops`."""
        return await asyncio.to_thread(self.job.hops)

    async def status(self) -> str:
        """Celery's state of the job's run task: PENDING, SUCCESS, FAILURE, REVOKED."""
        return await asyncio.to_thread(self.job.status)

    async def cancel(self) -> None:
        """See :meth:`Job.cancel`."""
        await self.client.cancel(self.id)

    def ends_with(self, chunk: GenerateResponse) -> bool:
        """Whether ``chunk`` ends what :meth:`stream` gives (its final chunk)."""
        return chunk.done

    def reader(
        self,
        timeout: float | None = None,
        cancel_on_close: bool = True,
        after: int = 0,
        lapse_on_close: bool = False,
    ) -> Reader:
        """What :meth:`stream` gives, as an async iterator to close (``aclose()``) when
        done with: leaving it early cancels the job as :meth:`stream` says. One coroutine
        waits in it, where :meth:`stream` adds an async generator around it (the gateway,
        which holds one for each waiting client, reads this). Unlike :meth:`stream`'s
        generator, it is not closed when dropped: its reader closes it. A subclass that
        gives its chunks otherwise overrides this (:meth:`stream` gives what it gives)."""
        wait = self.client.timeout if timeout is None else timeout
        return JobReader(self, wait, cancel_on_close, after, lapse_on_close)

    async def stream(
        self,
        timeout: float | None = None,
        cancel_on_close: bool = True,
        after: int = 0,
        lapse_on_close: bool = False,
    ) -> AsyncIterator[GenerateResponse]:
        """Chunks in order, then the final one with the stats (see :meth:`Job.stream`).

        Leaving the loop early (``break``, ``aclose()``, the task being cancelled) cancels
        the job unless ``cancel_on_close`` is False, or, with ``lapse_on_close``, once the
        reader's lease has lapsed with no other reader (a stream another reader may pick
        up: api_client/gateway/resume.py); ``after`` resumes after that ``seq``.
        """
        chunks = self.reader(timeout, cancel_on_close, after, lapse_on_close)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def _cancel_as_it_goes(self) -> None:
        """The stream is being torn down: cancel without awaiting anything that could itself
        be cancelled half-way; with Redis away, once it is back."""
        try:
            await asyncio.shield(self.cancel())
        except REDIS_AWAY:
            self.cancel_once_back()

    def cancel_once_back(self) -> None:
        """Cancel the job as soon as Redis answers again (its reader lost Redis)."""
        self.client.leases.cancel(self.id, self.client.settings.stream_ttl_s)

    async def result(self, timeout: float | None = None) -> GenerateResponse:
        """The final record with the whole text (raises the job's typed error)."""
        return GenerateResponse.model_validate(await self.final(timeout))

    async def final(self, timeout: float | None = None) -> dict[str, Any]:
        """The job's final record as stored, awaited on its result channel (or its stream's
        final chunk, when the result was lost: :meth:`Job.final`)."""
        wait = self.client.timeout if timeout is None else timeout
        end, raw = await self._stored(wait)
        if end is not None:
            return self.job.from_stream_end(end)
        assert raw is not None
        app, r = self.client.sync.app, self.client.r
        with contextlib.suppress(redis.RedisError):  # its reader has it: kept a while more
            await r.expire(result_key(app, self.id), self.job.read_ttl_s)
        return self.job.outcome(*stored(app, raw))

    async def _stored(self, wait: float) -> tuple[dict[str, Any] | None, bytes | str | None]:
        """Wait for the job's result: the stored result, or its stream's final chunk when
        STREAM_END_LOOKS looks in a row found the stream ended and no result."""
        app, r = self.client.sync.app, self.client.r
        key = result_key(app, self.id)
        sub = await self.client.hub.open(key)  # first: a result stored after the GET wakes us
        try:
            deadline = time.monotonic() + wait
            checked = time.monotonic()
            ends = StreamEnds(self.job)
            while not result_ready(app, raw := await r.get(key)):
                if time.monotonic() - checked > CHECK_EVERY_S:  # lost, or lost on the way?
                    end = await self.job.acheck(r, ends, self.client.streams.of(self.id)[0])
                    if end is not None:
                        return end, None
                    checked = time.monotonic()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobTimeout(
                        f"job {self.id} did not finish within {wait} s; it may still be queued "
                        "or running: await result() again, or check `ggufq ps`"
                    )
                await sub.get_message(timeout=min(left, 1.0))
            return None, raw
        finally:
            await sub.aclose()


class JobReader:
    """:meth:`AsyncJob.stream`'s chunks as an async iterator (:meth:`AsyncJob.reader`):
    followed through the client's shared connection, read again from the last one seen
    once Redis answers after going away (within the reader's lease, see
    :meth:`Job._chunks`), the reader's lease held while it reads, and the job cancelled
    when it is closed (``aclose()``) or its task cancelled before the job's end."""

    __slots__ = (  # one a waiting client: no dict each
        "job",
        "wait",
        "after",
        "cancel_on_close",
        "lapse_on_close",
        "lease",
        "follower",
        "done",
        "ended",
    )

    def __init__(
        self, job: AsyncJob, wait: float, cancel_on_close: bool, after: int, lapse_on_close: bool
    ) -> None:
        self.job, self.wait, self.after = job, wait, after
        self.cancel_on_close, self.lapse_on_close = cancel_on_close, lapse_on_close
        self.lease: ReaderLease | None = None
        self.follower: ChunkFollower | None = None
        self.done = self.ended = False

    def __aiter__(self) -> JobReader:
        return self

    async def __anext__(self) -> GenerateResponse:
        if self.ended:
            raise StopAsyncIteration
        follower = self._follower()
        try:
            return self._handed(await follower.__anext__())
        except StopAsyncIteration:
            self._end(gave_up=False)
            raise
        except asyncio.CancelledError:
            try:
                if self._cancels():
                    await self.job._cancel_as_it_goes()
            finally:
                self._end(gave_up=True)
            raise
        except redis.RedisError:  # Redis lost for longer than the lease: nobody reads it
            if self.cancel_on_close and not self.lapse_on_close:
                self.job.cancel_once_back()
            self._end(gave_up=True)
            raise
        except TimeoutError:
            self._end(gave_up=False)
            raise self.job.job.silent_for(self.wait) from None
        except BaseException:
            self._end(gave_up=False)
            raise

    def _follower(self) -> ChunkFollower:
        """What follows the job's chunks: made, with the reader's lease, at the first read."""
        if self.follower is not None:
            if self.lease is not None:
                self.lease.handed_at = None  # the last chunk was taken
            return self.follower
        job, host = self.job, self.job.client
        self.lease = job.job.reader_lease(self.cancel_on_close)
        if self.lease is not None:  # renewed with every other reader's: one round trip a second
            host.leases.hold(self.lease)
        ride_out_s = host.settings.reader_lease_s
        stream, hub = host.streams.of(job.id)
        self.follower = ChunkFollower(
            stream, job.id, self.wait, self.after, self, hub, QUIET_S, ride_out_s
        )
        return self.follower

    async def __call__(self) -> None:
        """Its follower's look at the job after a quiet spell (:meth:`Job.acheck`): the
        reader itself, not a callable made for each of a gateway's waiting clients."""
        job = self.job
        await job.job.acheck(job.client.r, stream=job.client.streams.of(job.id)[0])

    def _handed(self, chunk: dict[str, Any]) -> GenerateResponse:
        """``chunk`` as handed out (its error raised)."""
        job = self.job.job
        job.first_read_at = job.first_read_at or time.time()
        if chunk.get("done"):
            self.done = True
            error = chunk.get("error")
            if error:
                raise error_from_code(error["code"], error["message"])
        if self.lease is not None:
            self.lease.handed_at = time.monotonic()
        return job._response(chunk)

    def _cancels(self) -> bool:
        """Whether leaving now cancels the job."""
        return self.cancel_on_close and not self.done and not self.lapse_on_close

    async def aclose(self) -> None:
        """Stop reading: before the job's end, this cancels it as :meth:`AsyncJob.stream`
        says."""
        follower = self.follower
        if self.ended or follower is None:  # ended, or nothing read and nothing held
            self.ended = True
            return
        try:
            if self._cancels():
                await self.job._cancel_as_it_goes()
        finally:
            self._end(gave_up=True)
            await follower.aclose()

    def _end(self, gave_up: bool) -> None:
        self.ended = True
        if self.lease is not None:  # a reader that gave up before its job ended leaves its
            # lease to lapse, which cancels the job as a reader that went away does (one
            # that timed out lets go: its job is "still queued or running")
            self.job.client.leases.let_go(self.lease, keep=gave_up and not self.done)

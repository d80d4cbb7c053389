"""A submitted job's handle: its chunks as they stream, its result, its cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol, cast

import redis
import redis.asyncio
from celery import Celery
from celery.result import AsyncResult

from api_client.results import StreamEnds, result_key
from scheduler.errors import (
    GgufqError,
    JobCancelled,
    JobFailed,
    JobLost,
    JobTimeout,
    error_from_code,
)
from scheduler.protocol import GenerateResponse, JobRequest
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.cancel import ReaderLease
from scheduler.store.chunk_reading import ChunkSources, read_chunks
from scheduler.store.connection import REDIS_AWAY, ride_out
from scheduler.store.hops import ordered as ordered_hops
from scheduler.store.hops import read as read_hops
from scheduler.store.leases import ThreadLeases
from scheduler.store.streams import Entries
from scheduler.store.whereabouts import Whereabouts, alook_if_due, look_if_due

log = logging.getLogger(__name__)


class JobHost(Protocol):
    """What a job needs of the client that submitted it (``Client`` is one)."""

    r: redis.Redis
    app: Celery
    timeout: float
    settings: Settings
    streams: ChunkSources  # where each job's chunks are read: its stream's Redis, pub/sub
    leases: ThreadLeases  # the reader leases of its streams, renewed together

    def cancel(self, job_id: str) -> None: ...

    def place(self, request: JobRequest) -> None:
        """Send the job's message to placement (again: it places a job once)."""


RESEND_AFTER_S = 5.0  # a job not taken by placement this long with its queue empty
CHECK_EVERY_S = 2.0  # a reader waiting for a result checks the job this often


class Job:
    """A submitted job: its id is the same in the client, the placement service and the worker."""

    __slots__ = (
        "client",
        "id",
        "model",
        "kind",
        "priority",
        "submitted_at",
        "_request",
        "resend",
        "_sent_at",
        "first_read_at",
        "_where",
    )  # a gateway holds one a waiting answer: no dict each

    def __init__(self, client: JobHost, request: JobRequest, resend: bool = True) -> None:
        self.client = client
        self.id = request.id
        self.model, self.kind, self.priority = request.model, request.kind, request.priority
        self.submitted_at = request.submitted_at
        # the whole request as JSON (its defaults left out: parsing fills them in again),
        # parsed again only to send it again: a gateway holds thousands of waiting jobs,
        # and the parsed request costs three times the bytes
        self._request = request.model_dump_json(exclude_defaults=True).encode()
        self.resend = resend  # False for a handle without the job's whole request
        self._sent_at = 0.0  # when check() last sent it to placement again
        self.first_read_at = 0.0  # when a reader here had its first chunk (hops.py)
        self._where: Whereabouts | None = None  # a waiting reader's looks: is it lost?

    @property
    def request(self) -> JobRequest:
        """The job as submitted."""
        return JobRequest.model_validate_json(self._request)

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, model={self.model!r})"

    def status(self) -> str:
        """Celery's state of the job's run task: PENDING, STARTED, SUCCESS, FAILURE."""
        return str(AsyncResult(self.id, app=self.client.app).state)

    def cancel(self) -> None:
        """Ask for the job to stop: a queued or parked job never starts, a running one
        frees its slot within one decode step; its result then raises JobCancelled."""
        self.client.cancel(self.id)

    def stream(
        self, timeout: float | None = None, cancel_on_close: bool = True, after: int = 0
    ) -> Iterator[GenerateResponse]:
        """Chunks in order, from the first, then the final one with the stats.

        ``timeout`` bounds the wait for each next chunk (None = the client's default).
        Leaving the loop before the final chunk (``break``, closing the iterator, Ctrl-C)
        cancels the job, as a client that disconnects does, unless ``cancel_on_close`` is
        False. ``after`` resumes after the chunk with that ``seq``: a reader that dropped
        its stream reopens it with the last ``seq`` it saw and misses nothing.
        """
        wait = self.client.timeout if timeout is None else timeout
        done = gave_up = False
        lease = self.reader_lease(cancel_on_close)
        if lease is not None:  # renewed by the client's thread, whatever this loop's pace
            self.client.leases.hold(lease)
        try:
            for chunk in self._chunks(wait, after):
                self.first_read_at = self.first_read_at or time.time()
                if chunk.get("done"):
                    done = True
                    error = chunk.get("error")
                    if error:
                        raise error_from_code(error["code"], error["message"])
                if lease is not None:
                    lease.handed_at = time.monotonic()
                yield self._response(chunk)
                if lease is not None:
                    lease.handed_at = None
        except (GeneratorExit, KeyboardInterrupt):  # Ctrl-C in the loop: the reader is gone
            gave_up = True
            if cancel_on_close and not done:
                with contextlib.suppress(*REDIS_AWAY):  # Redis away: its lease lapses
                    self.cancel()
            raise
        except redis.RedisError:  # Redis lost for longer than the lease: it lapses
            gave_up = True
            raise
        except TimeoutError:
            raise self.silent_for(wait) from None
        finally:
            if lease is not None:  # a reader that gave up before its job ended, its cancel
                # perhaps lost with Redis, leaves its lease to lapse: the job is cancelled
                self.client.leases.let_go(lease, keep=gave_up and not done)

    def _chunks(self, wait: float, after: int) -> Iterator[dict[str, Any]]:
        """The job's chunks after ``after``, read again from the last one seen once Redis
        answers after going away (restarted, or a replica promoted by Sentinel), if it
        does within the reader's lease (GGUFQ_READER_LEASE_S): past that the job is
        cancelled as a reader gone, and the error is raised."""
        while True:
            stream, subscriptions = self.client.streams.of(self.id)
            try:
                for chunk in read_chunks(stream, self.id, wait, after, self.check, subscriptions):
                    after = chunk.get("seq") or after
                    yield chunk
                return
            except REDIS_AWAY as exc:
                log.warning(
                    "job %s's stream lost Redis (%s): reading on once it answers", self.id, exc
                )
                ride_out(stream.ping, self.client.settings.reader_lease_s, exc)

    def silent_for(self, wait: float) -> JobTimeout:
        """The error of a stream that sent nothing for ``wait`` s (the job goes on)."""
        return JobTimeout(
            f"job {self.id} sent nothing for {wait} s; it is still queued or running: "
            f"wait longer, or check `ggufq ps` and the worker logs"
        )

    def result(self, timeout: float | None = None) -> GenerateResponse:
        """The final record with the whole text, from the Celery result backend."""
        return GenerateResponse.model_validate(self.final(timeout))

    def final(self, timeout: float | None = None) -> dict[str, Any]:
        """The job's final record as stored (raises the job's typed error): its result, or
        its stream's final chunk when STREAM_END_LOOKS looks in a row found its stream ended
        and no result (the result was lost: Redis restarted from a snapshot taken between
        the two writes)."""
        wait = self.client.timeout if timeout is None else timeout
        handle = AsyncResult(self.id, app=self.client.app)
        deadline = time.monotonic() + wait
        ends = StreamEnds(self)
        try:
            while True:  # in slices: between them, see that Redis still knows the job
                left = deadline - time.monotonic()
                try:
                    value = handle.get(timeout=max(min(left, CHECK_EVERY_S), 0.01), propagate=False)
                    break
                except Exception as exc:  # celery.exceptions.TimeoutError and backend errors
                    if type(exc).__name__ != "TimeoutError":
                        raise
                if time.monotonic() >= deadline:
                    raise JobTimeout(
                        f"job {self.id} did not finish within {wait} s; it may still be queued "
                        "or running: call result() again, or check `ggufq ps`"
                    ) from None
                self.check()
                end = ends.look()
                if end is not None:
                    return self.from_stream_end(end)
        finally:
            # a result given up on stays subscribed in Celery's result consumer, which then
            # retries for 20 s once the client closes its connections: let go of it here
            handle.backend.remove_pending_result(handle)
        with contextlib.suppress(redis.RedisError):
            self.client.r.expire(result_key(self.client.app, self.id), self.read_ttl_s)
        return self.outcome(handle.state, value)

    def outcome(self, state: str, value: Any) -> dict[str, Any]:
        """The final record of a stored result in ``state`` (raises the job's error)."""
        if state == "FAILURE":
            if isinstance(value, GgufqError):
                raise value
            raise JobFailed(f"job {self.id} failed: {value}")
        if state == "REVOKED":  # the reason was stored with the state
            raise JobCancelled(str(value) or f"job {self.id} was cancelled")
        return cast(dict[str, Any], value)

    @property
    def read_ttl_s(self) -> int:
        """How long its result is kept once its reader has it (GGUFQ_RESULT_READ_TTL_S)."""
        settings = self.client.settings
        return min(settings.result_ttl_s, settings.result_read_ttl_s)

    def stream_end(self) -> dict[str, Any] | None:
        """The stream's final chunk, when the stream has ended and that chunk is the whole
        final record (an embedding's vectors travel in its result only: None for those)."""
        if self.kind == "embed":
            return None
        try:
            last = cast(Entries, self._stream().xrevrange(keys.job_chunks(self.id), count=1))
        except redis.RedisError:
            return None  # Redis away: the next look tells
        return self._end_of(last)

    def _stream(self) -> redis.Redis:
        """The Redis the job's stream lives on."""
        return self.client.streams.of(self.id)[0]

    def _end_of(self, last: Entries) -> dict[str, Any] | None:
        """The final chunk among the stream's last entry ``last``, if it is one (never for
        an embedding: its vectors travel in its result only)."""
        if self.kind == "embed":
            return None
        try:
            chunk = json.loads(last[0][1][b"c"])
        except (ValueError, KeyError, TypeError, IndexError):
            return None
        return chunk if isinstance(chunk, dict) and chunk.get("done") else None

    def from_stream_end(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The final record a stream's final chunk holds (raises the job's typed error)."""
        error = chunk.get("error")
        if error:
            raise error_from_code(error["code"], error["message"])
        log.warning(
            "job %s: its stream ended and no result was stored (lost, or its worker is still "
            "finishing): its final chunk is the result",
            self.id,
        )
        return {k: v for k, v in chunk.items() if k != "seq"}

    def hops(self) -> dict[str, float]:
        """When the job passed each hop on its way to its first chunk (wall-clock seconds,
        in path order: ``scheduler.store.hops.HOPS``); complete once its result is stored.
        ``first_chunk_read`` is there when it was read through this handle."""
        found = read_hops(self.client.r, self.id)
        if self.first_read_at:
            found["first_chunk_read"] = self.first_read_at
        return ordered_hops(found)

    def reader_lease(self, cancel_on_close: bool) -> ReaderLease | None:
        """A reader that cancels on close also cancels if its process dies: its lease
        lapses (None for a reader that does not cancel)."""
        settings = self.client.settings
        return ReaderLease.for_reader(
            self.id, cancel_on_close, settings.stream_ttl_s, settings.reader_lease_s
        )

    def check(self) -> None:
        """What a waiting reader does between waits: raise JobLost when Redis no longer
        knows the job (restarted without its data), or holds it nowhere its custody record
        says (whereabouts.py), which would never end; send the job to placement again when
        its message was lost on the way (Redis went away as placement took it off the
        queue), which placement would never see."""
        pipe = self.client.r.pipeline(transaction=False)
        self._check_commands(pipe)
        try:
            claimed, placed, queued, traces = pipe.execute()
        except redis.RedisError:
            return  # Redis away: the next check tells
        if self._lost_on_the_way(claimed, placed, queued, traces):
            self._send_again()
        self._where = look_if_due(self.client.r, self._stream, self.id, self._where)

    async def acheck(
        self,
        r: redis.asyncio.Redis,
        ends: StreamEnds | None = None,
        stream: redis.asyncio.Redis | None = None,
    ) -> dict[str, Any] | None:
        """:meth:`check` on redis.asyncio, in one round trip with a look at the stream's end
        when ``ends`` is given (two where the ``stream`` lives on a Redis of its own):
        returns what ``ends`` makes of it (:meth:`StreamEnds.seen`)."""
        stream = r if stream is None else stream
        pipe = r.pipeline(transaction=False)
        self._check_commands(pipe)
        if ends is not None and stream is r:
            pipe.xrevrange(keys.job_chunks(self.id), count=1)
        try:
            claimed, placed, queued, traces, *last = await pipe.execute()
            if ends is not None and stream is not r:
                last = [await stream.xrevrange(keys.job_chunks(self.id), count=1)]
        except redis.RedisError:
            return None  # Redis away: the next check tells
        if self._lost_on_the_way(claimed, placed, queued, traces):
            await asyncio.to_thread(self._send_again)
        self._where = await alook_if_due(r, stream, self.id, self._where)
        return ends.seen(self._end_of(last[0])) if ends is not None else None

    def _check_commands(self, pipe: Any) -> None:
        pipe.exists(keys.job_submitted(self.id))  # its id's claim
        pipe.exists(keys.job_placed(self.id), keys.job_custody(self.id))  # placed: not resent
        pipe.llen(keys.placement_queue(self.priority))
        # what is left of a job placed: its custody record (kept GGUFQ_STREAM_TTL_S after
        # it ends), its stream and its result
        pipe.exists(
            keys.job_custody(self.id),
            keys.job_chunks(self.id),
            result_key(self.client.app, self.id),
        )

    def _lost_on_the_way(self, claimed: int, placed: int, queued: int, traces: int) -> bool:
        """Raise JobLost for a job Redis no longer knows, or one that ended so long ago that
        its outcome is no longer kept; True when the job must be sent to placement again
        (its message lost on the way)."""
        # known while its id's claim or any trace is there: a job running through a restart
        # of Redis without its data writes its stream and result again; one waiting longer
        # than its id's claim lives has its custody record
        if not (claimed or traces):
            if self._streamed_apart():
                return False  # it streams on: nothing is sent again, nothing lost
            raise JobLost(
                f"job {self.id} is gone: Redis no longer knows it (it was restarted without "
                "its data, or the job's records expired); submit the job again"
            )
        if placed and not traces:
            raise JobLost(
                f"job {self.id} ended long ago and its result is no longer kept (it is kept "
                "GGUFQ_RESULT_READ_TTL_S once read, GGUFQ_RESULT_TTL_S if never); submit "
                "the job again"
            )
        if placed or queued or not self.resend:
            return False
        return time.time() - max(self._sent_at, self.submitted_at) >= RESEND_AFTER_S

    def _streamed_apart(self) -> bool:
        """Whether the job's stream, where it lives on a Redis of its own, is there: the
        control Redis restarted without its data while the job streams on."""
        stream = self._stream()
        if stream is self.client.r:
            return False
        try:
            return bool(stream.exists(keys.job_chunks(self.id)))
        except redis.RedisError:
            return True  # not known yet: the next check tells

    def _send_again(self) -> None:
        log.warning("job %s never reached placement (Redis went away?): sending it again", self.id)
        self._sent_at = time.time()
        try:
            self.client.place(self.request)
        except Exception as exc:  # the broker is away again: the next check tries again
            log.warning("sending job %s again failed: %s", self.id, exc)

    def _response(self, chunk: dict[str, Any]) -> GenerateResponse:
        if chunk.get("done"):
            return GenerateResponse.model_validate(chunk)
        return GenerateResponse(
            model=self.model,
            job_id=self.id,
            created_at=time.time(),
            response=chunk.get("response", ""),
            thinking=chunk.get("thinking", ""),
            seq=chunk.get("seq"),
        )

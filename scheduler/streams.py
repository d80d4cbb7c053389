"""Token chunks of a job: published on Redis pub/sub, recorded in a replayable stream.

Every chunk carries ``seq`` (1, 2, ...). The stream's entry ids are ``0-<seq>``, so a reader
that subscribed late, or lost its connection, reads what it missed with one XRANGE and then
follows the channel: nothing is lost and nothing is seen twice.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import redis
import redis.asyncio

from scheduler import keys
from scheduler.errors import GgufqError, JobCancelled
from scheduler.procs import lower_thread_priority

Entries = list[tuple[bytes, dict[bytes, bytes]]]
log = logging.getLogger(__name__)


def add_chunk(pipe: Any, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int) -> None:
    """Queue the commands that publish and record one chunk on a pipeline."""
    payload = json.dumps(dict(chunk, seq=seq))
    stream = keys.job_chunks(job_id)
    pipe.xadd(stream, {"c": payload}, id=f"0-{seq}")
    pipe.publish(keys.job_channel(job_id), payload)
    if seq == 1 or chunk.get("done"):
        pipe.expire(stream, ttl_s)


class Pending:
    """A chunk queued in a :class:`ChunkWriter`; text may join it until the writer takes it."""

    __slots__ = ("job_id", "seq", "chunk", "ttl_s", "taken")

    def __init__(self, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int) -> None:
        self.job_id, self.seq, self.chunk, self.ttl_s = job_id, seq, chunk, ttl_s
        self.taken = False


class ChunkWriter:
    """Writes chunks from a background thread, so a decode loop never waits on Redis.

    Chunks of all jobs go through one FIFO. The thread sends at most one pipeline every
    ``interval_s``: a job's first chunk, and any after a quiet spell, go out at once; the
    next ones wait out the interval and go out together, so a runner streaming many
    sequences wakes the writer and Redis a few times a second rather than at every decode
    step (each wake takes a core from llama.cpp's threads mid-step). Text published while
    the job's previous chunk still waits joins that chunk (:meth:`extend`): one entry and
    one message instead of one per token, for Redis and for the reader. ``flush`` cuts the
    wait short and returns once everything queued before it is in Redis.
    """

    def __init__(self, client: redis.Redis, nice: int = 0, interval_s: float = 0.0) -> None:
        self.r = client
        self.nice = nice  # added to the writer thread's niceness (see procs.py)
        self.interval_s = interval_s
        self._queue: queue.SimpleQueue[Pending | threading.Event | None]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()  # between extend and the writer taking a batch
        self._hurry = threading.Event()  # set by flush and close: write without waiting
        self._thread = threading.Thread(target=self._run, name="ggufq-chunks", daemon=True)
        self._thread.start()

    def put(self, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int) -> Pending:
        pending = Pending(job_id, seq, dict(chunk), ttl_s)
        self._queue.put(pending)
        if seq == 1:  # a job's first chunk (its time to first token) does not wait
            self._hurry.set()
        return pending

    def extend(self, pending: Pending | None, chunk: dict[str, Any]) -> bool:
        """Add a text-only chunk's text to ``pending`` if that is text-only too and still
        queued; False when it has to be a chunk of its own."""
        if pending is None or chunk.keys() != {"response"}:
            return False
        with self._lock:
            if pending.taken or pending.chunk.keys() != {"response"}:
                return False
            pending.chunk["response"] += chunk["response"]
            return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        done = threading.Event()
        self._queue.put(done)
        self._hurry.set()
        return done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._hurry.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        lower_thread_priority(self.nice)
        last = -float("inf")
        while True:
            batch = [self._queue.get()]
            if isinstance(batch[0], Pending):  # a chunk: wait out the interval (or a flush)
                self._hurry.wait(last + self.interval_s - time.monotonic())
            self._hurry.clear()
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            chunks = [item for item in batch if isinstance(item, Pending)]
            with self._lock:
                for chunk in chunks:
                    chunk.taken = True
            waiters = [item for item in batch if isinstance(item, threading.Event)]
            if chunks:
                self._write(chunks)
            last = time.monotonic()
            for waiter in waiters:
                waiter.set()
            if any(item is None for item in batch):
                return

    def _write(self, chunks: list[Pending]) -> None:
        """One pipeline for ``chunks``, tried three times. redis-py empties a pipeline
        once it has run, so each try builds it again; an entry a failed try had already
        added is refused as a duplicate id (ignored here), and a repeated PUBLISH is
        dropped by readers, which go by ``seq``."""
        for attempt in range(3):
            pipe = self.r.pipeline(transaction=False)
            for c in chunks:
                add_chunk(pipe, c.job_id, c.seq, c.chunk, c.ttl_s)
            try:
                results = pipe.execute(raise_on_error=False)
            except redis.RedisError as exc:
                problem = str(exc)
            else:
                failed = [r for r in results if isinstance(r, Exception) and not _dup(r)]
                if not failed:
                    return
                problem = str(failed[0])
            log.warning("writing %d chunks failed (try %d): %s", len(chunks), attempt + 1, problem)
            time.sleep(0.2 * (attempt + 1))
        log.error("gave up writing %d chunks; their readers will time out", len(chunks))


def _dup(error: Exception) -> bool:
    """XADD's answer to an entry id the stream already has (a retried write)."""
    return "equal or smaller" in str(error)


class ChunkPublisher:
    """Publishes the chunks of one job, in order: directly, or through a ChunkWriter."""

    def __init__(
        self, client: redis.Redis, job_id: str, ttl_s: int, writer: ChunkWriter | None = None
    ) -> None:
        self.r = client
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.writer = writer
        self.seq = 0
        self._pending: Pending | None = None  # the last chunk put to the writer

    def publish(self, chunk: dict[str, Any]) -> None:
        if self.writer is not None:
            if self.writer.extend(self._pending, chunk):
                return
            self.seq += 1
            self._pending = self.writer.put(self.job_id, self.seq, chunk, self.ttl_s)
            return
        self.seq += 1
        pipe = self.r.pipeline(transaction=False)
        add_chunk(pipe, self.job_id, self.seq, chunk, self.ttl_s)
        pipe.execute()

    def flush(self) -> None:
        """Return once every chunk published so far is in Redis."""
        if self.writer is not None:
            self.writer.flush()


def error_chunk(model: str, job_id: str, exc: GgufqError, **fields: Any) -> dict[str, Any]:
    """The final chunk of a job that failed or was cancelled (the reader raises ``exc``)."""
    reason = "cancel" if isinstance(exc, JobCancelled) else "error"
    return dict(
        fields,
        model=model,
        job_id=job_id,
        created_at=time.time(),
        response="",
        done=True,
        done_reason=reason,
        error={"code": exc.code, "message": str(exc)},
    )


def progress(client: redis.Redis, job_id: str) -> tuple[int, bool]:
    """(chunks recorded so far, whether the final one is among them)."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.job_chunks(job_id))
    pipe.xrevrange(keys.job_chunks(job_id), count=1)
    count, last = pipe.execute()
    finished = bool(last) and bool(json.loads(last[0][1][b"c"]).get("done"))
    return int(count), finished


def publish_final(client: redis.Redis, job_id: str, chunk: dict[str, Any], ttl_s: int) -> None:
    """Record the final chunk of a job from a process that published nothing before it."""
    stream = keys.job_chunks(job_id)
    last = cast(list[tuple[bytes, Any]], client.xrevrange(stream, count=1))
    publisher = ChunkPublisher(client, job_id, ttl_s)
    publisher.seq = int(last[0][0].decode().split("-")[1]) if last else 0
    publisher.publish(dict(chunk, done=True))


class ChunkOrder:
    """What a reader of a job's chunks does next, without I/O (both readers below use it).

    Chunks come first from the job's stream record (XRANGE, a backfill), then from pub/sub.
    A chunk out of order, or a quiet spell, means one may have been lost: backfill again.
    The quiet spell doubles from 1 s up to ``QUIET_MAX_S`` while nothing comes (a job waiting
    for a slot would otherwise wake its reader and Redis every second) and is 1 s again
    after each chunk.
    """

    QUIET_MAX_S = 8.0

    def __init__(
        self,
        job_id: str,
        timeout_s: float | None,
        after_seq: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id, self.timeout_s = job_id, timeout_s
        self.clock = clock
        self.last = after_seq
        self.backfill = True  # subscribed first, so the record holds all we could have missed
        self.done = False
        self.quiet_s = 1.0
        self.deadline = None if timeout_s is None else self.clock() + timeout_s

    @property
    def backfill_from(self) -> str:
        return f"0-{self.last + 1}"

    def from_record(self, entries: Entries) -> list[dict[str, Any]]:
        """The backfilled chunks to yield, up to the final one."""
        chunks = []
        for _id, fields in entries:
            chunk = json.loads(fields[b"c"])
            self.last = chunk["seq"]
            chunks.append(chunk)
            if chunk.get("done"):
                self.done = True
                break
        self.backfill = False
        return chunks

    def wait_s(self) -> float:
        """How long to wait for the next message; TimeoutError when the time is up."""
        if self.deadline is None:
            return self.quiet_s
        wait = min(self.quiet_s, self.deadline - self.clock())
        if wait <= 0:
            raise TimeoutError(f"no chunk of job {self.job_id} for {self.timeout_s} s")
        return wait

    def from_message(self, message: dict[str, Any] | None) -> dict[str, Any] | None:
        """The chunk to yield, if the message carries the next one."""
        if message is None:
            self.backfill = True  # quiet for a while: re-check the record in case we lost one
            self.quiet_s = min(self.quiet_s * 2, self.QUIET_MAX_S)
            return None
        self.quiet_s = 1.0
        chunk = json.loads(message["data"])
        if chunk["seq"] != self.last + 1:
            self.backfill = chunk["seq"] > self.last + 1
            return None
        self.last = chunk["seq"]
        if self.timeout_s is not None:
            self.deadline = self.clock() + self.timeout_s
        self.done = bool(chunk.get("done"))
        return chunk


def read_chunks(
    client: redis.Redis, job_id: str, timeout_s: float | None, after_seq: int = 0
) -> Iterator[dict[str, Any]]:
    """Yield the chunks of a job from ``after_seq + 1`` on, until the final one.

    Raises TimeoutError when no chunk arrives for ``timeout_s`` seconds.
    """
    order = ChunkOrder(job_id, timeout_s, after_seq)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.job_channel(job_id))
    try:
        while not order.done:
            if order.backfill:
                entries = client.xrange(keys.job_chunks(job_id), min=order.backfill_from)
                yield from order.from_record(cast(Entries, entries))
                continue
            chunk = order.from_message(pubsub.get_message(timeout=order.wait_s()))
            if chunk is not None:
                yield chunk
    finally:
        pubsub.close()


async def aread_chunks(
    client: redis.asyncio.Redis, job_id: str, timeout_s: float | None, after_seq: int = 0
) -> AsyncIterator[dict[str, Any]]:
    """:func:`read_chunks` on redis.asyncio: subscribe, backfill with XRANGE, then follow.

    Raises TimeoutError when no chunk arrives for ``timeout_s`` seconds.
    """
    order = ChunkOrder(job_id, timeout_s, after_seq)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.job_channel(job_id))
    try:
        while not order.done:
            if order.backfill:
                entries = await client.xrange(keys.job_chunks(job_id), min=order.backfill_from)
                for backfilled in order.from_record(cast(Entries, entries)):
                    yield backfilled
                continue
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=order.wait_s()
            )
            chunk = order.from_message(message)
            if chunk is not None:
                yield chunk
    finally:
        await pubsub.aclose()

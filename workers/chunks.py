"""How a worker writes its jobs' chunks: in order per job, batched across jobs, off the decode
thread (the records and channels are :mod:`scheduler.store.streams`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from scheduler.local.procs import lower_thread_priority
from scheduler.midstream import TOKENS
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.scripts import execute
from scheduler.store.shards import Shards
from scheduler.store.streams import queue_chunk
from workers.first_chunk import FirstChunks, Sent
from workers.pending import Pending

log = logging.getLogger(__name__)


class ChunkWriter:
    """Writes chunks from background threads, so a decode loop never waits on Redis.

    Chunks go through one FIFO per Redis the jobs' streams live on (one, unless
    GGUFQ_STREAM_REDIS_URLS names several: scheduler/store/shards.py), each with its own
    thread (:class:`_Lane`), so that an instance that is away holds back its own jobs'
    chunks only. A thread sends at most one pipeline every ``interval_s``: a job's first
    chunk, and any after a quiet spell, go out at once; the next ones wait out the interval
    and go out together, so a runner streaming many sequences wakes the writer and Redis a
    few times a second rather than at every decode step (each wake takes a core from
    llama.cpp's threads mid-step). Text published while the job's previous chunk still
    waits joins that chunk (:meth:`extend`): one entry and one message instead of one per
    token, for Redis and for the reader. ``flush`` cuts the wait short and returns once
    everything queued before it (of one job, when named) is in Redis.
    """

    def __init__(
        self,
        client: redis.Redis | Shards[redis.Redis],
        nice: int = 0,
        interval_s: float = 0.0,
        outage_s: float = 120.0,
        on_fenced: Callable[[str, str], None] = lambda _job_id, _placement_id: None,
    ) -> None:
        # the Redis of each job's stream (scheduler/store/shards.py)
        self.streams = client if isinstance(client, Shards) else Shards(client)
        # told (job id, placement id) of a run whose chunk was refused: another placement of
        # the job owns its stream now (placed again, or sent again), so that run stops
        self.on_fenced = on_fenced
        # first chunks, sent from the text relay: on a connection to each stream's Redis
        self.firsts = self.streams.map(FirstChunks)
        self.outage_s = outage_s  # how long chunks wait for Redis to come back
        self.give_up_at = float("inf")  # monotonic; set by close: no lane waits past it
        self.closing_since = float("inf")  # monotonic; when close began
        self.nice = nice  # added to the writer threads' niceness (see procs.py)
        self.interval_s = interval_s
        self.lock = threading.Lock()  # between extend and a lane taking a batch
        self._lanes = {id(r): _Lane(self, r) for r in self.streams.all}

    def _lane(self, job_id: str) -> _Lane:
        return self._lanes[id(self.streams.of(job_id))]

    def put(
        self, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
    ) -> Pending:
        pending = Pending(job_id, seq, dict(chunk), ttl_s, fence)
        lane = self._lane(job_id)
        lane.queue.put(pending)
        if seq == 1:  # a job's first chunk (its time to first token) does not wait
            lane.hurry.set()
        return pending

    def write_now(self, pending: Pending) -> bool:
        """Send a job's first chunk from the caller's (decode) thread at once, without
        waiting for Redis's answer, which its lane's thread reads, at its next write,
        before it writes anything queued after it (workers/first_chunk.py); False when it
        was not sent (then :meth:`put` it)."""
        lane = self._lane(pending.job_id)
        if not self.firsts.of(pending.job_id).send(pending, lane.queue.put):
            return False
        # its answer is read when the lane next writes: the next chunks (of every job
        # there) wait out the interval from here, as after any write
        lane.last_write = time.monotonic()
        return True

    def extend(self, pending: Pending | None, chunk: dict[str, Any]) -> bool:
        """Add a text-only chunk's text (answer or thinking) and its tokens to ``pending``
        if that is text of the same kind only and still queued; False when it has to be a
        chunk of its own."""
        name = _text_kind(chunk)  # answer text, or thinking text
        if pending is None or name is None:
            return False
        with self.lock:
            held = pending.chunk
            if pending.taken or _text_kind(held) != name:
                return False
            held[name] += chunk[name]
            if TOKENS in chunk:  # in place: a chunk that waits long does not cost its square
                held.setdefault(TOKENS, []).extend(chunk[TOKENS])
            return True

    def flush(self, timeout_s: float = 30.0, job_id: str | None = None) -> bool:
        """True once every chunk queued before (of ``job_id`` only, when given: its lane)
        is in Redis, or given up on; False after ``timeout_s``."""
        lanes = [self._lane(job_id)] if job_id is not None else list(self._lanes.values())
        waits = [lane.flush() for lane in lanes]
        deadline = time.monotonic() + timeout_s
        return all(done.wait(max(0.0, deadline - time.monotonic())) for done in waits)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued and stop the lanes. After ``timeout_s`` (in all), chunks
        held back for a Redis found away since close began are given up on, as past the
        outage (a lane that found it away only before gets one more try); close waits
        for the lanes until a second after that."""
        for first in self.firsts.all:  # every first chunk sent is queued before the end:
            first.stop()  # answers read
        now = time.monotonic()  # a second close keeps the first's times if sooner
        self.closing_since = min(self.closing_since, now)
        self.give_up_at = min(self.give_up_at, now + timeout_s)
        for lane in self._lanes.values():
            lane.queue.put(None)
            lane.hurry.set()
        until = self.give_up_at + 1.0  # a lane between two tries notices at its next
        for lane in self._lanes.values():
            lane.thread.join(timeout=max(0.0, until - time.monotonic()))
        for first in self.firsts.all:
            first.close()

    def tell_fenced(self, job_id: str, fence: str) -> None:
        try:
            self.on_fenced(job_id, fence)
        except Exception:  # the writing thread goes on for every other job
            log.exception("telling job %s's run %s that it is fenced off failed", job_id, fence)


class _Lane:
    """The chunks of the jobs whose streams live on one Redis: a FIFO, and the thread that
    writes it in pipelines."""

    def __init__(self, writer: ChunkWriter, client: redis.Redis) -> None:
        self.writer, self.r = writer, client
        self.queue: queue.SimpleQueue[Pending | Sent | threading.Event | None]
        self.queue = queue.SimpleQueue()
        self.hurry = threading.Event()  # set by flush and close: write without waiting
        self.last_write = -float("inf")  # monotonic time of the last write
        self.away_at = -float("inf")  # monotonic: when the last try found Redis away
        self.thread = threading.Thread(target=self._run, name="ggufq-chunks", daemon=True)
        self.thread.start()

    def flush(self) -> threading.Event:
        done = threading.Event()
        self.queue.put(done)
        self.hurry.set()
        return done

    def _run(self) -> None:
        lower_thread_priority(self.writer.nice)
        while True:
            batch: list[Pending | Sent | threading.Event | None] = [self.queue.get()]
            if isinstance(batch[0], (Pending, Sent)):  # wait out the interval (or a flush)
                self.hurry.wait(self.last_write + self.writer.interval_s - time.monotonic())
            self.hurry.clear()
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            chunks = [item for item in batch if isinstance(item, Pending)]
            with self.writer.lock:
                for chunk in chunks:
                    chunk.taken = True
            waiters = [item for item in batch if isinstance(item, threading.Event)]
            sent = [item for item in batch if isinstance(item, Sent)]
            if sent:  # first chunks sent from a text relay: their answers come first
                again, fenced = _answers(sent)
                chunks = again + chunks  # ahead of their jobs' later chunks
                for pending in fenced:
                    self.writer.tell_fenced(pending.job_id, pending.fence)
            try:
                if chunks:
                    self._write(chunks)
            except Exception:  # a chunk that does not serialize: lose these, keep the thread
                log.exception("writing %d chunks failed; later chunks still go out", len(chunks))
            self.last_write = time.monotonic()
            for waiter in waiters:
                waiter.set()
            if any(item is None for item in batch):
                return

    def _write(self, chunks: list[Pending]) -> None:
        """One pipeline for ``chunks``: tried three times when Redis refuses it, and again
        and again for up to ``outage_s`` while Redis is away (the chunks wait, in order,
        and go out when it is back); chunks Redis took are not tried again. redis-py
        empties a pipeline once it has run, so each try builds it again; an entry a failed
        try had already added is refused as a duplicate id (the script skips it), and
        readers go by ``seq``."""
        since, tries, problem, away = time.monotonic(), 0, None, False
        while True:
            # closing: past its deadline a lane tries no more where Redis was away since
            # close began (an outage seen before it, which may have ended, earns one more
            # try), nor again after any other failure
            closing = time.monotonic() > self.writer.give_up_at
            if closing and (self.away_at >= self.writer.closing_since or (tries and not away)):
                problem = problem or "its Redis was away at the last write"
                self._give_up(chunks, tries, since, f"{problem}; the writer is closing")
                return
            chunks, problem, away = self._try_write(chunks)
            self.away_at = time.monotonic() if away else -float("inf")  # the last try's
            if not chunks:
                if tries:
                    log.warning("wrote held-back chunks after %d tries", tries)
                return
            tries += 1
            if time.monotonic() - since > self.writer.outage_s or (not away and tries >= 3):
                self._give_up(chunks, tries, since, problem)
                return
            if tries == 1 or not away:
                log.warning("writing %d chunks failed (try %d): %s", len(chunks), tries, problem)
            time.sleep(min(0.1 * tries, 0.5))

    def _give_up(
        self, chunks: list[Pending], tries: int, since: float, problem: str | None
    ) -> None:
        jobs = ", ".join(sorted({c.job_id for c in chunks}))
        log.error(
            "gave up writing %d chunks of jobs %s after %d tries in %.0f s (%s); "
            "their readers get ChunksLost",
            len(chunks),
            jobs,
            tries,
            time.monotonic() - since,
            problem,
        )

    def _try_write(self, chunks: list[Pending]) -> tuple[list[Pending], str | None, bool]:
        """Write ``chunks`` once (append.lua's calls again, in the same call, when Redis
        had lost the script): (those still to write, the problem, whether it is that
        Redis is away)."""
        pipe = self.r.pipeline(transaction=False)
        for c in chunks:
            queue_chunk(pipe, c.job_id, c.seq, c.chunk, c.ttl_s, c.fence)
        try:  # a script Redis lost: loaded, run again
            results: list[Any] = execute(pipe, raise_on_error=False)
        except redis.RedisError as exc:
            results = [exc] * len(chunks)
        written_at = time.time()
        left: list[Pending] = []
        problem, away = None, False
        for chunk, result in zip(chunks, results, strict=True):
            if isinstance(result, Exception):
                left.append(chunk)
                problem = problem or str(result)
                away = away or isinstance(result, REDIS_AWAY)
                continue
            chunk.written_at = written_at
            if result == 0:  # Appended.FENCED: that run is not the job's now
                self.writer.tell_fenced(chunk.job_id, chunk.fence)
        return left, problem, away


def _answers(sent: list[Sent]) -> tuple[list[Pending], list[Pending]]:
    """The answers to first chunks ``sent``, read where each was sent: those to write
    again, and those refused for their fence (FirstChunks.answers)."""
    again: list[Pending] = []
    fenced: list[Pending] = []
    for source in dict.fromkeys(item.source for item in sent):
        source_again, source_fenced = source.answers([i for i in sent if i.source is source])
        again += source_again
        fenced += source_fenced
    return again, fenced


def _text_kind(chunk: dict[str, Any]) -> str | None:
    """ "response" or "thinking" when that text is all ``chunk`` holds (with its tokens)."""
    if len(chunk) - (TOKENS in chunk) != 1:
        return None
    return "response" if "response" in chunk else "thinking" if "thinking" in chunk else None

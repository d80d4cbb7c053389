"""Cancelling jobs: a flag in Redis plus a broadcast, so whoever holds the job stops it.

The flag (kept as long as the job's stream) covers a job still waiting in a queue or
parked: placement and workers check it before starting one. The broadcast reaches the
worker that is running it, whose watcher keeps the set of cancelled ids that the decode
loop checks every step (an in-memory lookup, no Redis call per token).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from scheduler.errors import JobCancelled
from scheduler.loops import LoopHealth, start_loop
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY

log = logging.getLogger(__name__)


def cancelled_before_start(job_id: str) -> JobCancelled:
    return JobCancelled(f"job {job_id} was cancelled before it started")


def request_cancel(client: redis.Redis, job_id: str, ttl_s: int) -> None:
    pipe = client.pipeline()
    queue_cancel(pipe, job_id, ttl_s)
    pipe.execute()


def queue_cancel(pipe: Any, job_id: str, ttl_s: int) -> None:
    """Queue on a pipeline (sync or asyncio) the flag that cancels a job, and its broadcast."""
    pipe.set(keys.cancel_flag(job_id), 1, ex=ttl_s)
    pipe.publish(keys.CANCELS, job_id)


def is_cancelled(client: redis.Redis, job_id: str) -> bool:
    """Asked to cancel, or its reader (one that cancels when it goes away) died."""
    flag, wanted, reader = client.mget(watch_keys(job_id))
    return cancelled_by(flag, wanted, reader)


READER_LEASE_S = 4.0  # a reader renews its lease at least every third of this
# a reader whose consumer has not taken its last chunk for this long (a client that stopped
# reading) is let lapse, whatever its lease: a slow consumer is not a dead one
READER_STUCK_S = 15.0


class ReaderLease:
    """A streaming reader's sign of life, for a job that is to end if its reader goes away
    without a word (its process killed): while the lease is renewed the job runs; once it
    has lapsed, the job's worker (or placement, for a parked job) cancels it. Pure timing;
    the reader writes :meth:`commands` when :meth:`due` says so."""

    __slots__ = ("job_id", "ttl_s", "lease_s", "renewed_at", "handed_at")  # one a reader

    def __init__(self, job_id: str, ttl_s: int, lease_s: float = READER_LEASE_S) -> None:
        self.job_id, self.ttl_s, self.lease_s = job_id, ttl_s, lease_s
        self.renewed_at: float | None = None
        self.handed_at: float | None = None  # a chunk its consumer has not taken yet, since

    @classmethod
    def for_reader(
        cls, job_id: str, cancel_on_close: bool, ttl_s: int, lease_s: float
    ) -> ReaderLease | None:
        """The lease of a reader that cancels on close (None for one that does not)."""
        return cls(job_id, ttl_s, lease_s) if cancel_on_close else None

    def due(self, now: float) -> bool:
        return self.renewed_at is None or now - self.renewed_at >= self.lease_s / 3

    def renew(self, pipe: Any, now: float) -> None:
        """Queue the renewal on a pipeline (sync or asyncio) and note the time."""
        pipe.set(keys.job_reader(self.job_id), 1, ex=int(self.lease_s))
        pipe.set(keys.job_reader_wanted(self.job_id), 1, ex=self.ttl_s)
        self.renewed_at = now

    def release(self, pipe: Any) -> None:
        """The reader is done with the job (it ended, or the reader cancelled it)."""
        pipe.delete(keys.job_reader(self.job_id), keys.job_reader_wanted(self.job_id))


def watch_keys(job_id: str) -> list[str]:
    """The keys whose values (:func:`cancelled_by`) say whether a job is to end."""
    return [keys.cancel_flag(job_id), keys.job_reader_wanted(job_id), keys.job_reader(job_id)]


def cancelled_by(flag: object, wanted: object, reader: object) -> bool:
    """Whether the values of :func:`watch_keys` say the job is to end."""
    return bool(flag) or (bool(wanted) and not reader)


class CancelWatcher:
    """The cancelled jobs among those this process runs, kept current in a thread.

    Pub/sub loses messages while disconnected, so the flags of the watched jobs are also
    re-read every ``recheck_s`` seconds.
    """

    def __init__(
        self, client: redis.Redis, health: LoopHealth | None = None, recheck_s: float = 1.0
    ) -> None:
        self.r = client
        self.health = health or LoopHealth()
        self.recheck_s = recheck_s
        self._watched: set[str] = set()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        start_loop("cancels", self._listen, self._stop, self.health, 0.0, REDIS_AWAY)

    def stop(self) -> None:
        self._stop.set()

    def watch(self, job_id: str, cancelled: bool | None = None) -> Callable[[], bool]:
        """Start watching a job; returns the check its loop calls. ``cancelled`` is what
        Redis says (read here when None): the job is to be watched before it is read, so
        that a broadcast in between is not lost."""
        with self._lock:
            self._watched.add(job_id)
        if is_cancelled(self.r, job_id) if cancelled is None else cancelled:
            with self._lock:
                self._cancelled.add(job_id)
        return lambda: job_id in self._cancelled

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._watched.discard(job_id)
            self._cancelled.discard(job_id)

    def _listen(self) -> None:
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.CANCELS)
        try:
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=self.recheck_s)
                self.health.ok("cancels")  # a listener's step never returns: it is alive
                if message is None:
                    self._recheck()
                    continue
                job_id = message_text(message)
                with self._lock:
                    if job_id in self._watched:
                        self._cancelled.add(job_id)
        finally:
            pubsub.close()

    def _recheck(self) -> None:
        with self._lock:
            watched = sorted(self._watched - self._cancelled)
        if not watched:
            return
        values = self.r.mget([key for job_id in watched for key in watch_keys(job_id)])
        gone = {
            job_id
            for i, job_id in enumerate(watched)
            if cancelled_by(values[3 * i], values[3 * i + 1], values[3 * i + 2])
        }
        for job_id in gone:
            log.info("job %s is cancelled (asked, or its reader went away)", job_id)
        with self._lock:
            self._cancelled.update(gone)


def message_text(message: dict[str, Any]) -> str:
    """A pub/sub message's data as text; bytes that are not UTF-8 (nobody of ggufq sends
    them) become replacement characters, which match no job, rather than an exception."""
    data = message.get("data", b"")
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

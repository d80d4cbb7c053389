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

log = logging.getLogger(__name__)


def cancelled_before_start(job_id: str) -> JobCancelled:
    return JobCancelled(f"job {job_id} was cancelled before it started")


def request_cancel(client: redis.Redis, job_id: str, ttl_s: int) -> None:
    pipe = client.pipeline()
    pipe.set(keys.cancel_flag(job_id), 1, ex=ttl_s)
    pipe.publish(keys.CANCELS, job_id)
    pipe.execute()


def is_cancelled(client: redis.Redis, job_id: str) -> bool:
    return bool(client.exists(keys.cancel_flag(job_id)))


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
        start_loop("cancels", self._listen, self._stop, self.health, 0.0, (redis.RedisError,))

    def stop(self) -> None:
        self._stop.set()

    def watch(self, job_id: str) -> Callable[[], bool]:
        """Start watching a job; returns the check its loop calls."""
        with self._lock:
            self._watched.add(job_id)
        if is_cancelled(self.r, job_id):
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
        flags = self.r.mget([keys.cancel_flag(j) for j in watched])
        with self._lock:
            self._cancelled.update(j for j, f in zip(watched, flags, strict=True) if f)


def message_text(message: dict[str, Any]) -> str:
    """A pub/sub message's data as text; bytes that are not UTF-8 (nobody of ggufq sends
    them) become replacement characters, which match no job, rather than an exception."""
    data = message.get("data", b"")
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

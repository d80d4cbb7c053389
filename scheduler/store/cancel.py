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

import redis

from scheduler.errors import JobCancelled
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

    def __init__(self, client: redis.Redis, recheck_s: float = 1.0) -> None:
        self.r = client
        self.recheck_s = recheck_s
        self._watched: set[str] = set()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ggufq-cancels", daemon=True)

    def start(self) -> None:
        self._thread.start()

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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except redis.RedisError as exc:
                log.warning("cancel watcher: %s", exc)
                self._stop.wait(1.0)

    def _listen(self) -> None:
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.CANCELS)
        try:
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=self.recheck_s)
                if message is not None:
                    job_id = message["data"].decode()
                    with self._lock:
                        if job_id in self._watched:
                            self._cancelled.add(job_id)
                else:
                    self._recheck()
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

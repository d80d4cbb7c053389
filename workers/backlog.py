"""Redis writes that must not be lost to an outage: a job's end (its in-flight record and
counters), written again in order once Redis is back, so that no slot stays taken and no
job stays 'running' in placement's view after an outage."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from scheduler.store.connection import REDIS_AWAY

log = logging.getLogger(__name__)
T = TypeVar("T")

AWAY = REDIS_AWAY  # the write is tried again later


class Backlog:
    """Writes that failed while Redis was away, retried in order by :meth:`drain`.

    Bounded: past ``limit`` writes the oldest is dropped, with an error in the log (a
    worker cut off from Redis that long has lost its devices anyway: placement re-placed
    or failed their jobs).
    """

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._writes: deque[tuple[str, Callable[[], object]]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._writes)

    def run(self, what: str, write: Callable[[], object]) -> None:
        """Write now; if Redis is away, keep the write for :meth:`drain`. Behind writes
        already waiting, a new one waits too, so that they land in order."""
        if not self._writes:
            try:
                write()
                return
            except AWAY as exc:
                log.warning("%s failed, Redis is away (%s): done when it is back", what, exc)
        with self._lock:
            if len(self._writes) >= self.limit:
                dropped, _ = self._writes.popleft()
                log.error("dropped a write kept through a Redis outage: %s", dropped)
            self._writes.append((what, write))

    def drain(self) -> int:
        """Carry out the kept writes in order; raises the Redis error of the first that
        still fails (the caller's loop backs off). Returns how many went through."""
        done = 0
        while True:
            with self._lock:
                if not self._writes:
                    return done
                what, write = self._writes[0]
            try:
                write()
            except AWAY:
                raise
            except Exception:  # the write itself is refused, or a bug: never retried
                log.exception("%s failed after Redis came back", what)
            with self._lock:
                self._writes.popleft()
            done += 1


def patiently(do: Callable[[], T], what: str, give_up_s: float, pause_s: float = 0.25) -> T:
    """``do()``, tried again while Redis is away, for up to ``give_up_s`` seconds (then its
    error is raised): a job that arrives as Redis goes away waits for it, not fails."""
    deadline, tries = time.monotonic() + give_up_s, 0
    while True:
        try:
            return do()
        except AWAY as exc:
            if time.monotonic() >= deadline:
                raise
            tries += 1
            if tries == 1 or tries % 40 == 0:  # every 10 s or so, not every try
                log.warning("%s: Redis is away (%s); trying again (%d)", what, exc, tries)
            time.sleep(pause_s)

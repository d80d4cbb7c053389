"""Redis's clock, the one clock that judges liveness.

Heartbeats, holds and their deadlines are stamped inside the scripts with Redis's ``TIME``
(``lua/_clock.lua``), so a host whose clock is off by any amount neither drops a live
worker nor keeps a dead one. Python that compares against those stamps reads the same
clock: once (:func:`redis_now`) or through :class:`RedisClock`, which keeps this host's
offset from it so that a process placing jobs pays no round trip per job.
"""

from __future__ import annotations

import time
from typing import Any


def redis_now(client: Any) -> float:
    """Redis's time now, in seconds (one round trip)."""
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


class RedisClock:
    """This host's time moved onto Redis's clock by the offset last measured
    (:meth:`sync`, which a process calls from its heartbeat loop); before the first sync
    it is the host's own time."""

    def __init__(self, client: Any, local: Any = time.time) -> None:
        self.client = client
        self.local = local
        self.offset_s = 0.0

    def sync(self) -> float:
        """Measure the offset again; returns it."""
        before = self.local()
        return self.observe(redis_now(self.client), before, self.local())

    def observe(self, remote: float, before: float, after: float) -> float:
        """Take the offset from Redis's time ``remote``, read between this host's times
        ``before`` and ``after`` (taken as halfway through the round trip)."""
        self.offset_s = remote - (before + after) / 2
        return self.offset_s

    def now(self) -> float:
        return float(self.local()) + self.offset_s

"""Chaos behind Sentinel: bench/chaos.py's faults against a stack whose Redis is a primary,
a replica and three sentinels on loopback (issue 38), and the fault Sentinel is for.

    .venv/bin/python bench/chaos_sentinel.py [--trials 1] [--faults worker-kill,...]

Each fault gets its own stack, as in bench/chaos.py, on a ``redis+sentinel://`` URL
(tests/sentinels.py: down-after-milliseconds 1000). The faults of the processes (workers,
placement, a client) and of what travels (malformed messages, a clock behind) are
bench/chaos.py's, unchanged. Its Redis faults stop and start an embedded Redis, which a
Sentinel deployment has not; ``primary-failover`` stands for them: a burst of jobs is
submitted, the primary is SIGKILLed a moment later (writes not yet on the replica are
lost, as in a Redis crash), the sentinels promote the replica, and the old primary is
started again on its port (empty: no persistence), where the sentinels make it the new
primary's replica, so the next trial fails over again. Every process follows by itself.

Targets as bench/chaos.py's (0 hung, 0 run twice, 0 silent gaps, 0 leaked, 0 invariant
violations), and, for the failover, serving again within 10 s of the promotion. Prints a
table, each failure with its evidence, then one JSON line.
"""

from __future__ import annotations

import importlib
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import chaos

_sentinels = importlib.import_module("tests.sentinels")  # run-time: outside what mypy checks

FAILOVER = chaos.Fault(
    "primary-failover",
    "Redis primary SIGKILLed mid-burst, its replica promoted by the sentinels",
    "failover",
)
# every fault of bench/chaos.py but those of an embedded Redis process, then the failover
FAULTS = [f for f in chaos.FAULTS if not f.name.startswith("redis-")] + [FAILOVER]
BY_NAME = {f.name: f for f in FAULTS}


class SentinelCluster(chaos.Cluster):
    """bench/chaos.py's stack, its Redis a primary, a replica and three sentinels."""

    def __init__(self, root: Path, models: Path, behind_s: dict[str, int] | None = None) -> None:
        super().__init__(root, models, behind_s)
        self.group: Any = None
        self._group: AbstractContextManager[Any] | None = None

    def start(self) -> None:
        self._group = _sentinels.sentinel_group(self.root / "redis")
        self.group = self._group.__enter__()
        self.settings = chaos.settings_from(self.env, self.group.url)
        self.env["GGUFQ_REDIS_URL"] = self.group.url  # the children's
        super().start()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self._group is not None:
                self._group.__exit__(None, None, None)

    def heal(self, timeout_s: float = 90.0) -> list[str]:
        problems = super().heal(timeout_s)
        if not chaos.wait_for(self.group.replicated, timeout=60):
            problems.append("heal: the primary had no replica in sync within 60 s")
        return problems


class SentinelTrial(chaos.Trial):
    cl: SentinelCluster

    def fault_primary_failover(self) -> None:
        group = self.cl.group
        old = group.primary_port()
        if old is None:
            raise chaos.SetupFailed("no sentinel names a primary")
        self.burst(4)
        time.sleep(self.rng.uniform(0.0, 0.2))
        name = group.server_on(old)
        group.procs[name].kill()
        group.procs[name].wait(timeout=10)
        killed = time.monotonic()
        if chaos.wait_for(lambda: group.primary_port() not in (None, old), timeout=60):
            self.res.note(f"the replica was promoted {time.monotonic() - killed:.1f} s after")
        else:
            self.res.note("no replica was promoted within 60 s")
        group.start_again(name)


def main(argv: list[str] | None = None) -> None:
    chaos.main(argv, BY_NAME, SentinelCluster, SentinelTrial, __doc__, "chaos_sentinel")


if __name__ == "__main__":
    main()

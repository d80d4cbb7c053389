"""Custody deadlines: the sorted sets (``lua/_due.lua`` writes them in the same steps that
move a job) that placement's liveness look reads only below a cutoff, so that a look
costs the leases that came due, not the jobs in the cluster.

- ``ggufq:due:sent``: a job recorded as sent to a device and not started, from when its
  send counts (Redis's clock). The lost-send look reads those sent before its window, and
  moves one it found waiting in its queue further on (:meth:`Deadlines.look_again`).
- ``ggufq:due:counted``: a placement a runner counted whose in-flight record is not
  written yet, from when it was counted. The recount reads those counted longer ago than
  a placement process may hold a job.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import cast

import redis

from scheduler.protocol import SentJob
from scheduler.store import keys
from scheduler.store.clock import redis_now
from scheduler.store.records import text
from scheduler.store.scripts import script

LOOK_LIMIT = 5000  # deadlines one look reads at most: the rest wait for the next look


@dataclass(frozen=True)
class DueSend:
    """A job sent to ``device_id`` under ``placement_id`` whose start is due."""

    job_id: str
    placement_id: str
    device_id: str

    @property
    def member(self) -> str:
        return f"{self.job_id}|{self.placement_id}|{self.device_id}"

    @classmethod
    def parse(cls, member: str) -> DueSend | None:
        parts = member.rsplit("|", 2)  # a job id may hold '|'; placement and device ids not
        return cls(*parts) if len(parts) == 3 else None

    @classmethod
    def of(cls, record: SentJob) -> DueSend:
        placement = record.placement
        return cls(record.job.id, placement.id, placement.device_id)


class Deadlines:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._settle = script(client, "settle")

    def now(self) -> float:
        """Redis's time, which every deadline is stamped on."""
        return redis_now(self.r)

    # -- sends -------------------------------------------------------------------------
    def sends(self, before: float, limit: int = LOOK_LIMIT) -> list[DueSend]:
        """The sends due before ``before`` (Redis's clock), oldest first."""
        members = cast(
            list[bytes], self.r.zrangebyscore(keys.DUE_SENT, "-inf", f"({before}", 0, limit)
        )
        due = [DueSend.parse(text(m)) for m in members]
        unreadable = [m for m, d in zip(members, due, strict=True) if d is None]
        if unreadable:
            self.r.zrem(keys.DUE_SENT, *unreadable)
        return [d for d in due if d is not None]

    def records(self, sends: list[DueSend]) -> dict[DueSend, SentJob]:
        """The in-flight records of ``sends`` that are still theirs (one round trip): a
        send whose record is gone (its job ended or was reaped), unreadable (the reap deals
        with it) or another placement's (placed again) is left out."""
        pipe = self.r.pipeline(transaction=False)
        for due in sends:
            pipe.hget(keys.inflight(due.device_id), due.job_id)
        found = {}
        for due, raw in zip(sends, pipe.execute(), strict=True):
            record = None if raw is None else SentJob.parse(raw)
            if record is not None and DueSend.of(record) == due:
                found[due] = record
        return found

    def look_again(self, at: dict[DueSend, float]) -> None:
        """Move sends' deadlines on to ``at`` (only those still due: one started or ended
        meanwhile stays gone)."""
        if at:
            self.r.zadd(keys.DUE_SENT, {d.member: t for d, t in at.items()}, xx=True)

    def settled(self, sends: list[DueSend]) -> int:
        """Forget the deadlines of those of ``sends`` whose job started, ended or was placed
        again, judged again in the step that forgets them (lua/settle.lua)."""
        if not sends:
            return 0
        return int(self._settle(keys=[keys.DUE_SENT, keys.RUNNING], args=[d.member for d in sends]))

    # -- counts ------------------------------------------------------------------------
    def counts(self, before: float, limit: int = LOOK_LIMIT) -> dict[str, set[str]]:
        """Runner id → the placements it counted before ``before`` (Redis's clock) whose
        in-flight record was not written since."""
        members = self.r.zrangebyscore(keys.DUE_COUNTED, "-inf", f"({before}", 0, limit)
        due: dict[str, set[str]] = defaultdict(set)
        for member in cast(list[bytes], members):
            runner_id, _, placement_id = text(member).partition("|")
            due[runner_id].add(placement_id)
        return dict(due)

    def counts_settled(self, runner_id: str, placements: set[str]) -> None:
        if placements:
            self.r.zrem(keys.DUE_COUNTED, *[f"{runner_id}|{p}" for p in placements])

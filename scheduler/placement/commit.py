"""Carrying out a decision in the cluster's state: assign a job to a runner, or create a
runner and reserve its memory, or ask workers to unload idle runners. The state behind
:class:`Ledger` re-checks atomically (Redis's Lua scripts; an in-memory cluster in the
property tests), so a decision taken on a stale snapshot loses the race instead of
over-committing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.cluster import Snapshot
from scheduler.placement.verdict import Decision, Evict, Load, Park, Refuse, Route


class Ledger(Protocol):
    def assign(self, runner_id: str, placement_id: str, now: float) -> bool:
        """One more job (this placement of it) for a live runner; False if it is unloading
        or gone."""
        ...

    def reserve(
        self,
        runner_id: str,
        placement_id: str,
        reservations: dict[str, int],
        fields: dict[str, Any],
        now: float,
    ) -> bool:
        """Create a runner with one job (this placement of it), reserving its memory on
        every device it spans, all or nothing; False if a device can no longer hold its
        part."""
        ...

    def unload(self, runner_ids: list[str], snap: Snapshot) -> None:
        """Ask the workers of these idle runners to unload them."""
        ...


@dataclass(frozen=True)
class Assigned:
    """The job has a runner: send it to ``device_id``'s queue."""

    runner_id: str
    device_id: str
    device_ids: list[str] = field(default_factory=list)
    split_blocks: list[int] = field(default_factory=list)  # blocks per device, layer order
    n_gpu_layers: int = 0


@dataclass(frozen=True)
class Wait:
    """The job waits in the parked queue."""

    reason: str


LOST_RACE = None  # another placer changed the state first: decide again
Outcome = Assigned | Wait | Refuse | None


def commit(
    decision: Decision,
    runner_fields: Callable[[Load], dict[str, Any]],
    ledger: Ledger,
    snap: Snapshot,
    now: float,
    placement_id: str,
    new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:16],
) -> Outcome:
    """Carry out ``decision`` for the job's placement ``placement_id`` (what its runner
    counts); ``runner_fields`` gives the record of a runner a Load creates."""
    match decision:
        case Route(runner_id, device_id):
            if not ledger.assign(runner_id, placement_id, now):
                return LOST_RACE
            return Assigned(runner_id, device_id)
        case Load(device_id, _bytes, n_gpu_layers, split) as load:
            runner_id = new_id()
            fields = runner_fields(load)
            if not ledger.reserve(runner_id, placement_id, load.reservations, fields, now):
                return LOST_RACE
            kind = snap.device_by_id[device_id].kind
            return Assigned(
                runner_id,
                device_id,
                device_ids=list(load.reservations),
                split_blocks=[blocks for _dev, _bytes, blocks in split],
                n_gpu_layers=0 if kind == "cpu" else n_gpu_layers,
            )
        case Evict(runner_ids):
            ledger.unload(runner_ids, snap)
            return Wait(f"unloading idle runners {', '.join(runner_ids)} to make room")
        case Park(reason):
            return Wait(reason)
        case Refuse() as refuse:
            return refuse

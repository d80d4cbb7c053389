"""The :class:`scheduler.placement.commit.Ledger` of the real cluster: reservations and
assignments through the Lua scripts in Redis, unloads asked of workers through Celery."""

from __future__ import annotations

from typing import Any

from celery import Celery

from scheduler.cluster import Snapshot
from scheduler.store.celery_app import ask_unload
from scheduler.store.placement_state import PlacementState


class RedisLedger:
    """The :class:`Ledger` of the real cluster: Lua scripts in Redis, unloads through Celery."""

    def __init__(self, state: PlacementState, app: Celery, device_ttl_s: float) -> None:
        self.state, self.app, self.device_ttl_s = state, app, device_ttl_s

    def assign(self, runner_id: str, placement_id: str, now: float) -> bool:
        return self.state.assign(runner_id, placement_id, now)

    def reserve(
        self,
        runner_id: str,
        placement_id: str,
        reservations: dict[str, int],
        fields: dict[str, Any],
        now: float,
    ) -> bool:
        return self.state.reserve(
            runner_id, placement_id, reservations, fields, now, self.device_ttl_s
        )

    def unload(self, runner_ids: list[str], snap: Snapshot) -> None:
        by_id = {r.id: r for r in snap.runners}
        workers = {d.id: d.worker for d in snap.devices}
        for runner_id in runner_ids:
            device_id = next(iter(by_id[runner_id].devices))
            ask_unload(self.app, workers[device_id], runner_id)

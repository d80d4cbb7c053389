"""Typed views of the cluster that every process shares: devices, runners and the snapshot
placement decides on. Pure: no Redis, no clock."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

DEMAND_TAU_S = 600.0  # demand decays by e every 10 minutes


def decayed(score: float, last: float, now: float, tau_s: float = DEMAND_TAU_S) -> float:
    """A request count that decays exponentially with time: recent demand weighs most."""
    return score * math.exp(-max(0.0, now - last) / tau_s)


@dataclass(frozen=True)
class DeviceInfo:
    """What a worker advertises about one of its devices."""

    id: str
    host: str
    worker: str
    name: str
    kind: str  # gpu | vgpu | cpu
    total: int
    free: int
    virtual: bool
    uuid: str = ""


@dataclass(frozen=True)
class DeviceState:
    id: str
    worker: str
    queue: str
    kind: Literal["gpu", "vgpu", "cpu"]
    total: int
    reported_free: int
    reserved: int

    @property
    def free(self) -> int:
        """Free memory = min(reported free, total − Σ reservations)."""
        return max(0, min(self.reported_free, self.total - self.reserved))


@dataclass(frozen=True)
class RunnerState:
    id: str
    model: str
    config_key: str
    devices: dict[str, int]
    state: Literal["loading", "ready", "unloading"]
    in_flight: int
    expires_at: float  # <0 never expires
    last_used: float
    num_parallel: int = 1
    n_gpu_layers: int = -1  # -1: the whole model on its devices


def is_live(runner: RunnerState) -> bool:
    """Counts against its devices and takes jobs (loading or ready)."""
    return runner.state != "unloading"


def is_idle(runner: RunnerState) -> bool:
    """May be evicted: loaded and serving no job."""
    return runner.state == "ready" and runner.in_flight == 0


def eviction_order(demand: Mapping[str, float]) -> Callable[[RunnerState], Any]:
    """Cheapest victim first: never-expiring runners last, then the least demanded model,
    then the soonest expiry and the least recent use."""
    return lambda r: (r.expires_at < 0, demand.get(r.model, 0.0), r.expires_at, r.last_used)


@dataclass(frozen=True)
class Snapshot:
    devices: list[DeviceState]
    runners: list[RunnerState]
    parked: int = 0
    demand: Mapping[str, float] = field(default_factory=dict)  # model → decayed request count

    # Indexes built once per snapshot, so that a decision costs O(devices) plus the runners
    # of the job's model, not O(devices × runners). scheduler/placement/snapcache.py supplies them
    # ready-made, kept current between snapshots.
    @cached_property
    def live_by_model(self) -> Mapping[str, list[RunnerState]]:
        index: dict[str, list[RunnerState]] = {}
        for runner in filter(is_live, self.runners):
            index.setdefault(runner.model, []).append(runner)
        return index

    @cached_property
    def counts(self) -> Mapping[str, int]:
        """Live runners per device."""
        counts: dict[str, int] = {}
        for runner in filter(is_live, self.runners):
            for device_id in runner.devices:
                counts[device_id] = counts.get(device_id, 0) + 1
        return counts

    @cached_property
    def idle_by_device(self) -> Mapping[str, list[RunnerState]]:
        """Evictable runners per device, cheapest first (:func:`eviction_order`)."""
        index: dict[str, list[RunnerState]] = {}
        for runner in filter(is_idle, self.runners):
            for device_id in runner.devices:
                index.setdefault(device_id, []).append(runner)
        for runners in index.values():
            runners.sort(key=eviction_order(self.demand))
        return index

"""Typed views of the cluster that every process shares: devices, runners and the snapshot
placement decides on. Pure: no Redis, no clock."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field

DeviceKind = Literal["gpu", "vgpu", "cpu"]
RunnerPhase = Literal["loading", "ready", "unloading"]
DEMAND_TAU_S = 600.0  # demand decays by e every 10 minutes


def free_bytes(reported_free: int, total: int, reserved: int) -> int:
    """A device's free memory: min(reported free, total − Σ reservations), never negative."""
    return max(0, min(reported_free, total - reserved))


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
        return free_bytes(self.reported_free, self.total, self.reserved)


def device_order(device: DeviceState) -> int:
    """GPUs before CPUs: a job goes to a CPU device only when no GPU takes it."""
    return 1 if device.kind == "cpu" else 0


def free_order(device: DeviceState) -> tuple[int, int, str]:
    """The order :attr:`Snapshot.by_free` keeps: GPUs first, then by free memory, then id."""
    return (device_order(device), device.free, device.id)


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


def has_replica(runner: RunnerState, live_by_model: Mapping[str, list[RunnerState]]) -> bool:
    """Another live runner of the same model and configuration serves its jobs."""
    return any(
        other.id != runner.id and other.config_key == runner.config_key
        for other in live_by_model.get(runner.model, ())
    )


def eviction_order(
    demand: Mapping[str, float], live_by_model: Mapping[str, list[RunnerState]] | None = None
) -> Callable[[RunnerState], Any]:
    """Cheapest victim first: never-expiring runners last (a replica floor pinned by
    `ggufq load --replicas` among them), before them an idle replica (its model and
    configuration have another live runner, so unloading it forces no load) first, then
    the least demanded model, the soonest expiry and the least recent use, then the id (a
    total order: the snapshot cache and a full read rank ties alike). Without
    ``live_by_model`` no runner counts as a replica."""
    spares = {} if live_by_model is None else live_by_model  # no len() of a cache's view
    return lambda r: (
        r.expires_at < 0,
        not has_replica(r, spares),
        demand.get(r.model, 0.0),
        r.expires_at,
        r.last_used,
        r.id,
    )


@dataclass(frozen=True)
class Snapshot:
    devices: list[DeviceState]
    runners: list[RunnerState]
    parked: int = 0
    demand: Mapping[str, float] = field(default_factory=dict)  # model → decayed request count
    # models with parked jobs (placement passes a set read from Redis on first use)
    parked_models: Collection[str] = frozenset()

    # Indexes built once per snapshot, so that a decision costs O(devices) plus the runners
    # of the job's model, not O(devices × runners). scheduler/placement/snapcache.py supplies them
    # ready-made, kept current between snapshots.
    @cached_property
    def device_by_id(self) -> Mapping[str, DeviceState]:
        return {d.id: d for d in self.devices}

    @cached_property
    def by_free(self) -> Sequence[DeviceState]:
        """The devices in :func:`free_order` (a placement finds room by bisection)."""
        return sorted(self.devices, key=free_order)

    @cached_property
    def largest_total(self) -> int:
        return max((d.total for d in self.devices), default=0)

    @cached_property
    def live_by_model(self) -> Mapping[str, list[RunnerState]]:
        """Live runners per model, on alive devices only (never route to a dead one)."""
        alive = self.device_by_id
        on_alive = {
            model: [r for r in runners if all(d in alive for d in r.devices)]
            for model, runners in self.all_live_by_model.items()
        }
        return {model: runners for model, runners in on_alive.items() if runners}

    @cached_property
    def all_live_by_model(self) -> Mapping[str, list[RunnerState]]:
        """Live runners per model on any device, one whose beat lapsed included: replicas
        that placement may yet route to once their device beats again."""
        index: dict[str, list[RunnerState]] = {}
        for runner in filter(is_live, self.runners):
            index.setdefault(runner.model, []).append(runner)
        return index

    @cached_property
    def mean_live_demand(self) -> float:
        """The mean demand of the models with a live runner (what a reload weighs when
        placement rates victims); read only when a job needs an eviction."""
        models = list(self.live_by_model)
        return sum(self.demand.get(m, 0.0) for m in models) / max(1, len(models))

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
        """Evictable runners per device, cheapest first (:func:`eviction_order`, idle
        replicas first)."""
        index: dict[str, list[RunnerState]] = {}
        for runner in filter(is_idle, self.runners):
            for device_id in runner.devices:
                index.setdefault(device_id, []).append(runner)
        for runners in index.values():
            runners.sort(key=eviction_order(self.demand, self.live_by_model))
        return index


class DeviceView(BaseModel):
    """A device as listings show it (``Client.devices()``, ``ggufq devices``, metrics)."""

    model_config = ConfigDict(frozen=True)

    id: str
    host: str
    worker: str
    name: str
    kind: DeviceKind
    total: int
    reported_free: int  # what the driver (or the worker, for virtual GPUs) last reported
    reserved: int  # Σ reservations of the runners on it
    virtual: bool
    uuid: str = ""
    queue: str
    heartbeat: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def free(self) -> int:
        return free_bytes(self.reported_free, self.total, self.reserved)


class RunnerView(BaseModel):
    """A runner as listings show it (``Client.ps()``, ``ggufq ps``, metrics); Ollama's
    field names where its ``/api/ps`` has one (``model``, ``size``, ``context_length``,
    ``expires_at``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    model: str
    state: RunnerPhase
    devices: dict[str, int]  # bytes reserved per device
    bytes: int  # on its devices (the GPU share when partially offloaded)
    size: int  # the whole runner, its host share included
    context_length: int  # tokens per slot (num_ctx)
    num_parallel: int
    n_gpu_layers: int  # -1: every layer on its devices
    block_count: int
    embedding: bool
    in_flight: int
    keep_alive_s: float
    expires_at: float  # seconds since the epoch; -1 while busy or when it never expires
    last_used: float
    loaded_at: float | None = None  # None while loading
    worker: str = ""
    config_key: str = ""
    load_progress: float | None = None  # the fraction of its weights read (None: not begun)


class JobView(BaseModel):
    """A job not ended yet (``Client.jobs()``, ``ggufq jobs``): parked (waiting for memory),
    queued at its device's worker, or running."""

    model_config = ConfigDict(frozen=True)

    id: str
    model: str
    priority: Literal["interactive", "batch"]
    tenant: str = "default"
    state: Literal["parked", "queued", "running"]
    position: int  # parked: in retry order; queued: in its device's queue; running: 0
    model_position: int | None = None  # parked: among its model's parked jobs
    device: str | None = None
    submitted_at: float
    started_at: float | None = None


class CustodyView(BaseModel):
    """Where a job is, as its custody record says (``Client.custody()``, ``ggufq where``):
    its state (scheduler/custody.py), who holds it (a placement process, or the placement a
    device runs it under; "" for a queue), its epoch (raised at every move) and when it
    last moved, on Redis's clock. Kept for ``GGUFQ_STREAM_TTL_S`` after it ends."""

    model_config = ConfigDict(frozen=True)

    id: str
    state: str
    holder: str
    epoch: int
    moved_at: float


def by_expiry(runners: list[RunnerView]) -> list[RunnerView]:
    """Runners as Ollama's ``ps`` lists them: the longest time to expiry first (busy and
    pinned ones, which do not expire, before all), then in the order given."""
    return sorted(runners, key=lambda r: (r.expires_at >= 0, -r.expires_at))

"""Where a job runs: one pure function over a snapshot. No Redis, no logging, no clock.

The placement service builds the snapshot, calls :func:`decide`, and carries out the
returned decision (reserve, send, evict, park or refuse) at its edge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from scheduler.cluster import (
    DeviceState,
    RunnerState,
    Snapshot,
    eviction_order,
    is_live,
)
from scheduler.units import format_bytes

Policy = Literal["binpack", "spread"]


@dataclass(frozen=True)
class GroupNeeds:
    """What a model needs when its blocks are split over several GPUs of one worker."""

    per_block: tuple[int, ...]  # weights + KV cache of each block, in order
    per_device: int  # each GPU holds a compute buffer
    last: int  # the output layer, on the GPU that holds the last blocks


@dataclass(frozen=True)
class JobNeeds:
    model: str
    config_key: str
    bytes: int
    # partial[n] = GPU bytes with n layers offloaded (n = 1..block_count; llama.cpp's
    # n_gpu_layers, output layer first); empty when no partial offload is allowed
    partial: tuple[int, ...] = ()
    group: GroupNeeds | None = None  # None: the model may not span devices
    num_parallel: int | None = None  # slots the job asks for; None: any runner's
    # the job asks for this many layers on a GPU (``bytes`` is their GPU share); -1 = as
    # many as fit (any runner), 0 = the whole model on GPUs (no partial runner)
    n_gpu_layers: int = -1
    where: Where = field(default_factory=lambda: Where())
    retry: bool = False  # a parked job tried again: already counted among the parked


@dataclass(frozen=True)
class Where:
    """Which devices a job may use at all."""

    device: str | None = None  # pinned to this device
    avoid: tuple[str, ...] = ()  # its model failed to load there
    num_gpu: int = -1  # Ollama's: 0 = the CPU only; > 0 = that many layers, on GPUs only
    layers: int = 0  # how many layers that is for this model (for the message)

    @property
    def processor(self) -> Literal["any", "cpu", "gpu"]:
        return "cpu" if self.num_gpu == 0 else "gpu" if self.num_gpu > 0 else "any"


@dataclass(frozen=True)
class Route:
    runner_id: str
    device_id: str


@dataclass(frozen=True)
class Load:
    device_id: str
    bytes: int
    n_gpu_layers: int = -1  # -1 = the whole model on the device
    # a model split over several GPUs of one worker: device → (bytes, blocks), in layer order
    split: tuple[tuple[str, int, int], ...] = ()

    @property
    def reservations(self) -> dict[str, int]:
        if not self.split:
            return {self.device_id: self.bytes}
        return {device_id: nbytes for device_id, nbytes, _blocks in self.split}


@dataclass(frozen=True)
class Evict:
    runner_ids: list[str]


@dataclass(frozen=True)
class Park:
    reason: str


@dataclass(frozen=True)
class Refuse:
    code: Literal["no_capacity", "server_busy", "no_workers", "invalid_request", "load_failed"]
    reason: str
    per_device: dict[str, str] = field(default_factory=dict)


Decision = Route | Load | Evict | Park | Refuse


VictimKey = Callable[[RunnerState], Any]


def decide(
    job: JobNeeds,
    snap: Snapshot,
    policy: Policy,
    now: float,
    max_queue: int,
    max_loaded: int,
    victim_key: VictimKey | None = None,
) -> Decision:
    """Decide where ``job`` runs.

    1. No device is alive → refuse: no workers.
    2. The devices the job may use (the one it is pinned to; not those its model failed to
       load on; only the CPU for num_gpu 0, only GPUs for num_gpu > 0) are none of the
       alive ones → refuse, naming the alive devices.
    3. A runner of this model with the same configuration (and as many slots and GPU
       layers, when the job asks for a number) is loading or ready → route to the least
       busy replica.
    4. Earlier jobs of this model are parked → park behind them, so that a model's jobs keep
       their order (server busy past ``max_queue``). A parked job tried again is already
       counted among the parked: 4 and 9 never refuse it.
    5. Loaded with another configuration and idle → evict it (the reload happens on retry);
       busy → leave it and place a new runner beside it.
    6. Larger than every device (so no eviction makes it fit whole):
       a. fits on several GPUs of one worker → load it there (as 8);
       b. partial offload allowed → the most layers that fit on the GPU with the most free
          memory (the rest on the host); if no layer fits now but would on an emptier GPU
          → park;
       c. would span the GPUs of one worker once its idle runners are gone → evict the
          fewest of them; none idle → park;
       d. otherwise → refuse at once with the sizes.
    7. Fits whole on one device that holds fewer than ``max_loaded`` runners → load there;
       GPUs before the CPU; `binpack` picks the device with the least free memory left
       over, `spread` the most.
    8. Fits whole on several GPUs of one worker → the fewest devices, then the least free
       memory left over; blocks are split in order, each GPU filled before the next, the
       output layer with the last blocks.
    9. More than ``max_queue`` parked jobs → refuse at once: server busy.
    10. Fits on a device after unloading idle runners there → evict the fewest runners:
        runners that never expire last, then the models with the least recent demand (a
        request count decayed by e every DEMAND_TAU_S), then the soonest expiry, then least
        recently used; ``victim_key`` replaces that order (bench/cache_sim.py compares
        rules with it).
    11. Memory is held by busy runners → park.
    """
    # 1
    if not snap.devices:
        return Refuse(
            "no_workers", "no device is alive: start a worker with `ggufq up` or `ggufq worker`"
        )
    # 2
    usable = usable_part(snap, job)
    if isinstance(usable, Refuse):
        return usable
    if job.retry:
        max_queue += usable.parked + 1
    return _where(job, usable, policy, max_queue, max_loaded, victim_key)


def _where(
    job: JobNeeds,
    snap: Snapshot,
    policy: Policy,
    max_queue: int,
    max_loaded: int,
    victim_key: VictimKey | None,
) -> Decision:
    of_model = snap.live_by_model.get(job.model, [])
    # 3
    same = [
        r
        for r in of_model
        if r.config_key == job.config_key
        and job.num_parallel in (None, r.num_parallel)
        and job.n_gpu_layers in (-1, r.n_gpu_layers if r.n_gpu_layers > 0 else 0)
    ]
    if same:
        best = min(same, key=lambda r: (r.in_flight, r.last_used))
        return Route(best.id, next(iter(best.devices)))
    # 4
    if not job.retry and snap.parked and job.model in snap.parked_models:
        return behind_parked(job.model, snap.parked, max_queue)
    # 5
    stale = [r for r in of_model if r.in_flight == 0]
    if stale:
        return Evict([r.id for r in stale])
    # 6
    if job.bytes > max(d.total for d in snap.devices):
        return _larger_than_any_device(job, snap, max_loaded, victim_key)
    # 7
    counts = snap.counts
    fits = [d for d in snap.devices if d.free >= job.bytes and counts.get(d.id, 0) < max_loaded]
    if fits:
        return Load(_pick(fits, job.bytes, policy).id, job.bytes, max(-1, job.n_gpu_layers or -1))
    # 8
    if job.group is not None:
        spanning = _fewest_devices(job.group, snap, max_loaded)
        if spanning is not None:
            return spanning
    # 9
    if snap.parked >= max_queue:
        return server_busy(snap.parked, max_queue)
    # 10
    victims = _cheapest_victims(job, snap, max_loaded, victim_key)
    if victims:
        return Evict(victims)
    # 11
    return Park(f"memory for {job.model!r} ({format_bytes(job.bytes)}) is held by busy runners")


def _larger_than_any_device(
    job: JobNeeds, snap: Snapshot, max_loaded: int, victim_key: VictimKey | None
) -> Decision:
    # 6a
    spanning = _fewest_devices(job.group, snap, max_loaded) if job.group else None
    if spanning is not None:
        return spanning
    # 6b
    partial = _partial_offload(job, snap, max_loaded)
    if partial is not None:
        return partial
    # 6c
    if job.group and _fewest_devices(job.group, _emptied(snap), max_loaded):
        victims = _group_victims(job.group, snap, max_loaded, victim_key)
        if victims:
            return Evict(victims)
        return Park(f"{job.model!r} spans several GPUs whose memory is in use")
    # 6d
    largest = max(d.total for d in snap.devices)
    sizes = {d.id: f"total {format_bytes(d.total)}" for d in snap.devices}
    return Refuse(
        "no_capacity",
        f"model {job.model!r} needs {format_bytes(job.bytes)} but the largest device has "
        f"{format_bytes(largest)}; use a smaller num_ctx or num_parallel, a smaller "
        "quantization, or add a larger device",
        sizes,
    )


def usable_part(snap: Snapshot, job: JobNeeds) -> Snapshot | Refuse:
    """The part of the snapshot on the devices the job may use (branch 2)."""
    where, alive = job.where, ", ".join(d.id for d in snap.devices)
    if where.device is not None:
        snap = _restricted(snap, lambda d: d.id == where.device)
        if not snap.devices:
            return _none_left(f"device {where.device!r} is not alive", alive, "invalid_request")
    if where.avoid:
        snap = _restricted(snap, lambda d: d.id not in where.avoid)
        if not snap.devices:
            return _none_left(
                f"model {job.model!r} could not be loaded on {', '.join(where.avoid)} and no "
                "other device can take it",
                alive,
                "load_failed",
            )
    if where.processor == "cpu":
        snap = _restricted(snap, lambda d: d.kind == "cpu")
        if not snap.devices:
            return _none_left(
                "num_gpu 0 asks for the CPU but no CPU device is alive: start a worker with "
                "`ggufq worker --cpu`, or omit num_gpu",
                alive,
                "invalid_request",
            )
    if where.processor == "gpu":
        snap = _restricted(snap, lambda d: d.kind != "cpu")
        if not snap.devices:
            return _none_left(
                f"num_gpu {where.num_gpu} asks for {where.layers} layers on a GPU but no GPU is "
                "alive: omit "
                "num_gpu (or set -1) to run where the model fits",
                alive,
                "invalid_request",
            )
    return snap


def _restricted(snap: Snapshot, keep: Callable[[DeviceState], bool]) -> Snapshot:
    devices = [d for d in snap.devices if keep(d)]
    if len(devices) == len(snap.devices):
        return snap
    ids = {d.id for d in devices}
    runners = [r for r in snap.runners if set(r.devices) <= ids]
    return Snapshot(devices, runners, snap.parked, snap.demand, snap.parked_models)


def _none_left(why: str, alive: str, code: Literal["invalid_request", "load_failed"]) -> Refuse:
    return Refuse(code, f"{why}; alive devices: {alive} (`ggufq devices`)")


def behind_parked(model: str, parked: int, max_queue: int) -> Park | Refuse:
    if parked >= max_queue:
        return server_busy(parked, max_queue)
    return Park(f"earlier jobs for {model!r} are waiting")


def _partial_offload(job: JobNeeds, snap: Snapshot, max_loaded: int) -> Decision | None:
    gpus = [d for d in snap.devices if d.kind != "cpu"]
    if not job.partial or not gpus:
        return None
    room = [d for d in gpus if snap.counts.get(d.id, 0) < max_loaded]
    if room:
        best = max(room, key=lambda d: (d.free, d.id))
        layers = sum(1 for need in job.partial if need <= best.free)  # partial is increasing
        if layers:
            return Load(best.id, job.partial[layers - 1], n_gpu_layers=layers)
    if job.partial[0] <= max(d.total for d in gpus):
        return Park(f"no GPU has room for a layer of {job.model!r} now")
    return None


def _fewest_devices(group: GroupNeeds, snap: Snapshot, max_loaded: int) -> Load | None:
    by_worker: dict[str, list[DeviceState]] = {}
    for d in snap.devices:
        if d.kind != "cpu" and snap.counts.get(d.id, 0) < max_loaded:
            by_worker.setdefault(d.worker, []).append(d)
    best: tuple[int, int, str] | None = None
    chosen: Load | None = None
    for worker, devices in by_worker.items():
        devices.sort(key=lambda d: (-d.free, d.id))
        for k in range(2, len(devices) + 1):
            split = split_blocks(group, devices[:k])
            if split is not None:
                leftover = sum(d.free for d in devices[:k]) - sum(b for _, b, _ in split)
                if best is None or (k, leftover, worker) < best:
                    best, chosen = (k, leftover, worker), Load(split[0][0], 0, -1, split)
                break
    if chosen is None:
        return None
    return Load(chosen.device_id, sum(b for _, b, _ in chosen.split), -1, chosen.split)


def _group_victims(
    group: GroupNeeds, snap: Snapshot, max_loaded: int, key: VictimKey | None
) -> list[str]:
    """The fewest idle runners to unload on one worker's GPUs so that a group fits."""
    best: list[str] | None = None
    workers = {d.worker for d in snap.devices if d.kind != "cpu"}
    for worker in sorted(workers):
        gpus = [d for d in snap.devices if d.worker == worker and d.kind != "cpu"]
        on_worker = {d.id for d in gpus}
        idle = {r.id: r for d in gpus for r in snap.idle_by_device.get(d.id, [])}
        order = sorted(idle.values(), key=key or eviction_order(snap.demand))
        held = [r for r in snap.runners if is_live(r) and on_worker & set(r.devices)]
        chosen: list[str] = []
        for victim in order:
            chosen.append(victim.id)
            freed = {
                d: sum(r.devices.get(d, 0) for r in idle.values() if r.id in chosen)
                for d in on_worker
            }
            devices = [replace(d, reserved=max(0, d.reserved - freed[d.id])) for d in gpus]
            rest = [r for r in held if r.id not in chosen]
            if _fewest_devices(group, Snapshot(devices, rest), max_loaded):
                if best is None or len(chosen) < len(best):
                    best = list(chosen)
                break
    return best or []


def _emptied(snap: Snapshot) -> Snapshot:
    """The cluster with every runner gone: what could fit at all."""
    devices = [replace(d, reported_free=d.total, reserved=0) for d in snap.devices]
    return Snapshot(devices, [], snap.parked)


def split_blocks(
    group: GroupNeeds, devices: list[DeviceState]
) -> tuple[tuple[str, int, int], ...] | None:
    """Blocks in order over ``devices``, each filled before the next; None if they don't fit.

    Every device gets at least one block and its compute buffer; the last also gets the
    output layer. Returns (device id, bytes, blocks) per device.
    """
    split, start, n = [], 0, len(group.per_block)
    for i, device in enumerate(devices):
        last = i == len(devices) - 1
        room = device.free - group.per_device - (group.last if last else 0)
        stop = n - (len(devices) - 1 - i)  # leave a block for each device after this one
        used, end = 0, start
        while end < stop and used + group.per_block[end] <= room:
            used += group.per_block[end]
            end += 1
        if end == start or (last and end < n):
            return None
        fixed = group.per_device + (group.last if last else 0)
        split.append((device.id, used + fixed, end - start))
        start = end
    return tuple(split)


def server_busy(parked: int, max_queue: int) -> Refuse:
    return Refuse(
        "server_busy",
        f"server busy: {parked} jobs already wait for memory (max_queue {max_queue}); "
        "retry later or raise GGUFQ_MAX_QUEUE",
    )


def _device_order(device: DeviceState) -> int:
    return 1 if device.kind == "cpu" else 0


def _pick(devices: list[DeviceState], need: int, policy: Policy) -> DeviceState:
    if policy == "spread":
        return min(devices, key=lambda d: (_device_order(d), -d.free, d.id))
    return min(devices, key=lambda d: (_device_order(d), d.free - need, d.id))


def _cheapest_victims(
    job: JobNeeds, snap: Snapshot, max_loaded: int, key: VictimKey | None
) -> list[str]:
    best: list[str] | None = None
    for device in sorted(snap.devices, key=_device_order):
        if device.total < job.bytes:
            continue
        free, count, chosen = device.free, snap.counts.get(device.id, 0), []
        idle = snap.idle_by_device.get(device.id, [])
        for runner in sorted(idle, key=key) if key else idle:
            if free >= job.bytes and count < max_loaded:
                break
            chosen.append(runner.id)
            free += runner.devices[device.id]
            count -= 1
        enough = free >= job.bytes and count < max_loaded
        if enough and chosen and (best is None or len(chosen) < len(best)):
            best = chosen
    return best or []

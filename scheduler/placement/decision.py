"""Where a job runs: one pure function over a snapshot. No Redis, no logging, no clock.

The placement service builds the snapshot, calls :func:`decide`, and carries out the
returned decision (reserve, send, evict, park or refuse) at its edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from scheduler.cluster import DeviceState, RunnerState, Snapshot
from scheduler.placement.fitting import (
    Policy,
    VictimKey,
    cheapest_victims,
    emptied,
    fewest_devices,
    first_fit,
    group_victims,
    new_replica,
    partial_offload,
)
from scheduler.placement.needs import JobNeeds
from scheduler.placement.verdict import (
    Decision,
    Evict,
    Load,
    Park,
    Refuse,
    Route,
    behind_parked,
    runners_full,
    server_busy,
)
from scheduler.units import format_bytes


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
    3. Runners of this model with the same configuration (and as many slots and GPU
       layers, when the job asks for a number) are loading or ready: its replicas. A
       runner's load is its in-flight jobs (running or waiting at its worker; a loading
       runner counts with its slots).
       a. Fewer replicas than ``min_replicas`` (a pinned floor) → load one more where it
          fits whole, or evict idle runners of other models to make room (as 10): never
          on a device that holds one of its replicas, nor on the CPU while one runs on a
          GPU; devices without any runner of the model first; nothing while runners
          unloading make room for it; if nothing fits, go on.
       b. The runner that served the job's prompt prefix (``affine``) has a free slot →
          route there: its cached prefix makes the prompt cheaper. The bound of bounded-load
          affinity is the slot count: an affine job never waits while a replica is free.
       c. A replica has a free slot → route to the least busy, then least recently used.
       d. All are saturated and there are fewer than ``max_replicas`` (or the floor) →
          load another replica as in a, but evicting only idle replicas or idle runners
          of models less in demand than this one.
       e. Otherwise queue at the least busy (fewest jobs beyond its slots), or at the
          affine runner when it has at most ⌈AFFINITY_SLACK × slots⌉ more waiting. With
          ``queue_depth`` ≥ 0, park instead when every replica holds slots + queue_depth
          jobs (server busy past ``max_queue``): waiting work stays in the parked queue,
          retried in fair order across tenants, rather than in a worker's queue. Parked
          jobs of the model do not hold back a runner with room: they may wait for memory
          for another configuration.
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
    10. Fits on a device after unloading idle runners there → evict the cheapest set: on
        each device idle runners are taken in order (idle replicas first, runners that
        never expire last, then the models with the least recent demand, a request count
        decayed by e every DEMAND_TAU_S, then the soonest expiry, then least recently
        used) until the job fits, and the device whose set costs least wins (fewest
        runners that never expire, then the least demand it brings back: that of the
        models left with no runner, a share of an idle replica's, and a reload for each
        runner; then fewest runners: fitting.victims_cost); ``victim_key`` replaces that
        order, and the device with the fewest victims wins (bench/cache_sim.py compares
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
        return _among_replicas(job, snap, same, policy, max_queue, max_loaded, victim_key)
    # 4
    if not job.retry and snap.parked and job.model in snap.parked_models:
        return behind_parked(job.model, snap.parked, max_queue)
    # 5
    stale = [r for r in of_model if r.in_flight == 0]
    if stale:
        return Evict([r.id for r in stale])
    # 6
    if job.bytes > snap.largest_total:
        return _larger_than_any_device(job, snap, max_loaded, victim_key)
    # 7
    counts = snap.counts

    def room(d: DeviceState) -> bool:
        return counts.get(d.id, 0) < max_loaded

    def main(d: DeviceState) -> bool:  # Ollama's main_gpu: a host's GPU of that index
        return d.kind != "cpu" and d.id.endswith(f":{job.main_gpu}") and room(d)

    chosen = None if job.main_gpu is None else first_fit(snap.by_free, job.bytes, policy, main)
    chosen = chosen or first_fit(snap.by_free, job.bytes, policy, room)
    if chosen is not None:
        return Load(chosen.id, job.bytes, max(-1, job.n_gpu_layers or -1))
    # 8
    if job.group is not None:
        spanning = fewest_devices(job.group, snap, max_loaded)
        if spanning is not None:
            return spanning
    # 9
    if snap.parked >= max_queue:
        return server_busy(snap.parked, max_queue)
    # 10
    victims = cheapest_victims(job, snap, max_loaded, victim_key)
    if victims:
        return Evict(victims)
    # 11
    return Park(f"memory for {job.model!r} ({format_bytes(job.bytes)}) is held by busy runners")


def _among_replicas(
    job: JobNeeds,
    snap: Snapshot,
    same: list[RunnerState],
    policy: Policy,
    max_queue: int,
    max_loaded: int,
    victim_key: VictimKey | None,
) -> Decision:
    # 3a
    if len(same) < job.min_replicas:
        grown = new_replica(job, snap, same, policy, max_loaded, victim_key, floor=True)
        if grown is not None:
            return grown
    # 3b
    affine = next((r for r in same if r.id == job.affine), None)
    if affine is not None and affine.in_flight < affine.num_parallel:
        return _route(affine)
    # 3c
    free = [r for r in same if r.in_flight < r.num_parallel]
    if free:
        return _route(min(free, key=lambda r: (r.in_flight, r.last_used)))
    # 3d
    if len(same) < max(job.max_replicas, job.min_replicas):
        grown = new_replica(job, snap, same, policy, max_loaded, victim_key, floor=False)
        if grown is not None:
            return grown
    # 3e
    return _queue_at(job, snap, same, affine, max_queue)


def _queue_at(
    job: JobNeeds,
    snap: Snapshot,
    same: list[RunnerState],
    affine: RunnerState | None,
    max_queue: int,
) -> Decision:
    """Every replica is saturated: the one where the job waits least, or park."""
    depth = job.queue_depth
    room = [r for r in same if depth < 0 or _waiting(r) < depth]
    if not room:
        return runners_full(job.model, len(same), snap.parked, max_queue)
    least = min(room, key=lambda r: (_waiting(r), r.in_flight, r.last_used))
    if affine is not None and (depth < 0 or _waiting(affine) < depth):
        if _waiting(affine) <= _waiting(least) + _slack(affine):
            return _route(affine)
    return _route(least)


AFFINITY_SLACK = 0.25  # KubeAI's CHWBL bound (1 + ε) with ε = 0.25, in slots


def _waiting(r: RunnerState) -> int:
    return r.in_flight - r.num_parallel


def _slack(r: RunnerState) -> int:
    return max(1, math.ceil(AFFINITY_SLACK * r.num_parallel))


def _route(r: RunnerState) -> Route:
    return Route(r.id, next(iter(r.devices)))


def _larger_than_any_device(
    job: JobNeeds, snap: Snapshot, max_loaded: int, victim_key: VictimKey | None
) -> Decision:
    # 6a
    spanning = fewest_devices(job.group, snap, max_loaded) if job.group else None
    if spanning is not None:
        return spanning
    # 6b
    partial = partial_offload(job, snap, max_loaded)
    if partial is not None:
        return partial
    # 6c
    if job.group and fewest_devices(job.group, emptied(snap), max_loaded):
        victims = group_victims(job.group, snap, max_loaded, victim_key)
        if victims:
            return Evict(victims)
        return Park(f"{job.model!r} spans several GPUs whose memory is in use")
    # 6d
    largest = snap.largest_total
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
    where, everywhere = job.where, snap  # the devices alive, named only in a refusal
    if where.device is not None:
        snap = _restricted(snap, lambda d: d.id == where.device)
        if not snap.devices:
            return _none_left(
                f"device {where.device!r} is not alive", everywhere, "invalid_request"
            )
    if where.avoid:
        snap = _restricted(snap, lambda d: d.id not in where.avoid)
        if not snap.devices:
            return _none_left(
                f"model {job.model!r} could not be loaded on {', '.join(where.avoid)} and no "
                "other device can take it",
                everywhere,
                "load_failed",
            )
    if where.processor == "cpu":
        snap = _restricted(snap, lambda d: d.kind == "cpu")
        if not snap.devices:
            return _none_left(
                "num_gpu 0 asks for the CPU but no CPU device is alive: start a worker with "
                "`ggufq worker --cpu`, or omit num_gpu",
                everywhere,
                "invalid_request",
            )
    if where.processor == "gpu":
        snap = _restricted(snap, lambda d: d.kind != "cpu")
        if not snap.devices:
            return _none_left(
                f"num_gpu {where.num_gpu} asks for {where.layers} layers on a GPU but no GPU is "
                "alive: omit "
                "num_gpu (or set -1) to run where the model fits",
                everywhere,
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


def _none_left(why: str, snap: Snapshot, code: Literal["invalid_request", "load_failed"]) -> Refuse:
    alive = ", ".join(d.id for d in snap.devices)
    return Refuse(code, f"{why}; alive devices: {alive} (`ggufq devices`)")

"""How a model fits on the devices: the device a policy picks, the idle runners to evict,
a split over several GPUs of one worker, a partial offload, room for one more replica.
Pure, like the decision."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from scheduler.cluster import (
    DeviceState,
    RunnerState,
    Snapshot,
    device_order,
    eviction_order,
    has_replica,
    is_live,
)
from scheduler.placement.needs import GroupNeeds, JobNeeds
from scheduler.placement.verdict import Decision, Evict, Load, Park

Policy = Literal["binpack", "spread"]
VictimKey = Callable[[RunnerState], Any]
# rates a set of victims on one device, lowest first (cheapest_victims)
VictimsCost = Callable[[list[RunnerState], Snapshot], tuple[float, ...]]
# what each victim's eventual reload weighs in victims_cost, in models of mean demand.
# bench/belady_seeds.py, loads / Belady's over 20 traces, worst and median, without
# replicas: 0 → 1.191 1.056; 1 → 1.191 1.053; 2 → 1.191 1.025; 3 and 4 → 1.191 1.027
# (with 3 replicas and REPLICA_SHARE 0.5: 1.10 1.03 for 1.5–3). From 3 on, the only
# runner of a model with 90 % of the demand goes before two runners of 5 % each.
RELOAD_WEIGHT = 2.0
# what an idle replica's unloading brings back soon, as a share of its runner's part of
# its model's demand: it comes back when that demand needs every runner (belady_seeds.py
# with 3 replicas, worst and median: 0 → 1.148 1.071; 0.25 → 1.096 1.047; 0.5 → 1.098
# 1.034; 0.75 → 1.085 1.034; 1 → 1.110 1.051; the middle of the good range taken)
REPLICA_SHARE = 0.5


def partial_offload(job: JobNeeds, snap: Snapshot, max_loaded: int) -> Decision | None:
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


def fewest_devices(group: GroupNeeds, snap: Snapshot, max_loaded: int) -> Load | None:
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


def group_victims(
    group: GroupNeeds, snap: Snapshot, max_loaded: int, key: VictimKey | None
) -> list[str]:
    """The fewest idle runners to unload on one worker's GPUs so that a group fits."""
    best: list[str] | None = None
    workers = {d.worker for d in snap.devices if d.kind != "cpu"}
    for worker in sorted(workers):
        gpus = [d for d in snap.devices if d.worker == worker and d.kind != "cpu"]
        on_worker = {d.id for d in gpus}
        idle = {r.id: r for d in gpus for r in snap.idle_by_device.get(d.id, [])}
        order = sorted(idle.values(), key=key or eviction_order(snap.demand, snap.live_by_model))
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
            if fewest_devices(group, Snapshot(devices, rest), max_loaded):
                if best is None or len(chosen) < len(best):
                    best = list(chosen)
                break
    return best or []


def emptied(snap: Snapshot) -> Snapshot:
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


def first_fit(
    by_free: Sequence[DeviceState],
    need: int,
    policy: Policy,
    ok: Callable[[DeviceState], bool],
) -> DeviceState | None:
    """What :func:`pick` picks among the devices with ``need`` bytes free that ``ok``
    accepts, found by bisection in ``by_free`` (:attr:`Snapshot.by_free`): it reads the
    devices that fit, in the policy's order, until one is ``ok``, not every device."""
    for order in (0, 1):
        start = bisect.bisect_left(by_free, (order, need), key=lambda d: (device_order(d), d.free))
        end = bisect.bisect_left(by_free, (order + 1, 0), key=lambda d: (device_order(d), d.free))
        if policy != "spread":
            found = next((by_free[i] for i in range(start, end) if ok(by_free[i])), None)
        else:  # the most free; among equals the first id, which sorts first
            found = None
            for i in range(end - 1, start - 1, -1):
                device = by_free[i]
                if found is not None and device.free < found.free:
                    break
                if ok(device):
                    found = device
        if found is not None:
            return found
    return None


def pick(devices: list[DeviceState], need: int, policy: Policy) -> DeviceState:
    if policy == "spread":
        return min(devices, key=lambda d: (device_order(d), -d.free, d.id))
    return min(devices, key=lambda d: (device_order(d), d.free - need, d.id))


def cheapest_victims(
    job: JobNeeds,
    snap: Snapshot,
    max_loaded: int,
    key: VictimKey | None,
    devices: Sequence[DeviceState] | None = None,
    allowed: Callable[[RunnerState], bool] | None = None,
    cost: VictimsCost | None = None,
) -> list[str]:
    """The cheapest idle runners to unload on one device (of ``devices``, default all) so
    that the job fits there whole; only runners ``allowed`` accepts. On each device they
    are taken in eviction order until the job fits; among devices the set that ``cost``
    rates lowest wins: :func:`victims_cost`, or with a ``key`` the fewest runners."""
    rate = cost or (by_count if key else victims_cost)
    best: tuple[tuple[float, ...], list[str]] | None = None
    for device in sorted(snap.devices if devices is None else devices, key=device_order):
        if device.total < job.bytes:
            continue
        free, count, chosen = device.free, snap.counts.get(device.id, 0), []
        idle = [r for r in snap.idle_by_device.get(device.id, []) if not allowed or allowed(r)]
        for runner in sorted(idle, key=key) if key else replicas_first(idle, snap):
            if free >= job.bytes and count < max_loaded:
                break
            chosen.append(runner)
            free += runner.devices[device.id]
            count -= 1
        if not (free >= job.bytes and count < max_loaded and chosen):
            continue
        rated = rate(chosen, snap)
        if best is None or rated < best[0]:
            best = (rated, [r.id for r in chosen])
    return best[1] if best else []


def by_count(chosen: list[RunnerState], _snap: Snapshot) -> tuple[float, ...]:
    """The rating of a victim key's sets (bench/cache_sim.py's rules): the fewest runners."""
    return (float(len(chosen)),)


def victims_cost(chosen: list[RunnerState], snap: Snapshot) -> tuple[float, ...]:
    """What unloading ``chosen`` costs, cheapest first: the runners that never expire
    among them, then the loads it brings back: soon, the demand for the models left with
    no runner of that configuration, and :data:`REPLICA_SHARE` of an idle replica's part
    of its model's demand; in time one per runner, each weighed as :data:`RELOAD_WEIGHT`
    models of the mean demand of those loaded (:attr:`Snapshot.mean_live_demand`); then
    how many. Across 20 traces of ``bench/belady_seeds.py`` this takes the worst excess
    of loads over Belady's that taking the fewest runners had from 1.49 to 1.19 without
    replicas (the median from 1.13 to 1.03), and from 1.14 to 1.10 with 3."""
    pinned, left = 0, set()  # left: models the set leaves with no runner of a configuration
    going = Counter((r.model, r.config_key) for r in chosen) if len(chosen) > 1 else None
    spared = 0.0  # the replicas' share of demand
    for r in chosen:
        pinned += r.expires_at < 0
        n = going[(r.model, r.config_key)] if going else 1
        live = snap.live_by_model.get(r.model, ())
        if len(live) <= n or sum(o.config_key == r.config_key for o in live) <= n:
            left.add(r.model)
        else:
            spared += REPLICA_SHARE * snap.demand.get(r.model, 0.0) / len(live)
    demand = spared + sum(snap.demand.get(model, 0.0) for model in left)
    reloads = RELOAD_WEIGHT * len(chosen) * snap.mean_live_demand
    return (float(pinned), demand + reloads, float(len(chosen)))


def replicas_first(idle: list[RunnerState], snap: Snapshot) -> list[RunnerState]:
    """``idle`` in eviction order with idle replicas first (never-expiring runners still
    last), whoever built the index (a stable sort keeps the rest of the order)."""
    return sorted(idle, key=lambda r: (r.expires_at < 0, not has_replica(r, snap.live_by_model)))


def new_replica(
    job: JobNeeds,
    snap: Snapshot,
    same: list[RunnerState],
    policy: Policy,
    max_loaded: int,
    key: VictimKey | None,
    floor: bool,
) -> Load | Evict | None:
    """Room for one more runner of the job's model and configuration beside ``same``.

    Never on a device that holds one of ``same`` (a second runner there adds memory, not
    compute) nor on the CPU while one runs on a GPU (it would serve its share of jobs at a
    fraction of the speed); devices without any runner of the model first. Fits whole →
    load by ``policy``; else evict the cheapest idle runners of other models: for the
    ``floor`` any, for demand only idle replicas and models less in demand than this one.
    None when nothing fits, or when runners already unloading make room (a replica is on
    its way: evicting more for each waiting job would empty the cluster)."""
    allowed, preferred = replica_devices(job, snap, same)
    counts = snap.counts
    for group in (preferred, allowed):
        fits = [d for d in group if d.free >= job.bytes and counts.get(d.id, 0) < max_loaded]
        if fits:
            layers = max(-1, job.n_gpu_layers or -1)
            return Load(pick(fits, job.bytes, policy).id, job.bytes, layers)
    if unloading_makes_room(job, snap, allowed, max_loaded):
        return None
    hot = snap.demand.get(job.model, 0.0)

    def victim(r: RunnerState) -> bool:
        if r.model == job.model:
            return False
        cold = snap.demand.get(r.model, 0.0) < hot
        return floor or cold or has_replica(r, snap.live_by_model)

    for group in (preferred, allowed):
        victims = cheapest_victims(job, snap, max_loaded, key, group, victim)
        if victims:
            return Evict(victims)
    return None


def replica_devices(
    job: JobNeeds, snap: Snapshot, same: list[RunnerState]
) -> tuple[list[DeviceState], list[DeviceState]]:
    """The devices a new replica may use, and those of them without a runner of its model."""
    kinds = {d.id: d.kind for d in snap.devices}
    taken = {d for r in same for d in r.devices}
    on_gpu = any(kinds.get(d, "cpu") != "cpu" for d in taken)
    allowed = [d for d in snap.devices if d.id not in taken and not (on_gpu and d.kind == "cpu")]
    holders = {d for r in snap.live_by_model.get(job.model, ()) for d in r.devices}
    return allowed, [d for d in allowed if d.id not in holders]


def unloading_makes_room(
    job: JobNeeds, snap: Snapshot, devices: list[DeviceState], max_loaded: int
) -> bool:
    """A device of ``devices`` will hold the job once the runners unloading there are gone."""
    ids = {d.id for d in devices}
    pending: dict[str, int] = {}
    for r in snap.runners:
        if r.state == "unloading":
            for device_id in ids.intersection(r.devices):
                pending[device_id] = pending.get(device_id, 0) + r.devices[device_id]
    return any(
        d.free + pending[d.id] >= job.bytes and snap.counts.get(d.id, 0) < max_loaded
        for d in devices
        if d.id in pending
    )

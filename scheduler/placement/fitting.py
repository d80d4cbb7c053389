"""How a model fits on the devices: the device a policy picks, the idle runners to evict,
a split over several GPUs of one worker, a partial offload. Pure, like the decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from scheduler.cluster import DeviceState, RunnerState, Snapshot, eviction_order, is_live
from scheduler.placement.needs import GroupNeeds, JobNeeds
from scheduler.placement.verdict import Decision, Load, Park

Policy = Literal["binpack", "spread"]
VictimKey = Callable[[RunnerState], Any]


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


def device_order(device: DeviceState) -> int:
    return 1 if device.kind == "cpu" else 0


def pick(devices: list[DeviceState], need: int, policy: Policy) -> DeviceState:
    if policy == "spread":
        return min(devices, key=lambda d: (device_order(d), -d.free, d.id))
    return min(devices, key=lambda d: (device_order(d), d.free - need, d.id))


def cheapest_victims(
    job: JobNeeds, snap: Snapshot, max_loaded: int, key: VictimKey | None
) -> list[str]:
    best: list[str] | None = None
    for device in sorted(snap.devices, key=device_order):
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

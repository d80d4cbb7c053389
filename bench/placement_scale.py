"""Placement at scale: the pure decision and a placement through Redis, with 1,000 devices
and 5,000 runners in the snapshot.

    python bench/placement_scale.py [--devices 1000] [--runners 5000] [--decisions 2000]

Targets: decision p50 <= 1 ms; end to end through Redis (snapshot, decision, atomic
reservation) p50 <= 3 ms. The end-to-end path reads the snapshot through the placement
service's change-log cache (scheduler/placement/snapcache.py); the full re-read of every hash per
placement is measured too, as the baseline. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from scheduler.cluster import DeviceInfo, DeviceState, RunnerState, Snapshot  # noqa: E402
from scheduler.local.embedded import EmbeddedRedis  # noqa: E402
from scheduler.placement.decision import decide  # noqa: E402
from scheduler.placement.needs import JobNeeds  # noqa: E402
from scheduler.placement.snapcache import SnapshotCache  # noqa: E402
from scheduler.placement.verdict import Load, Route  # noqa: E402
from scheduler.store import keys  # noqa: E402
from scheduler.store.placement_state import PlacementState  # noqa: E402
from scheduler.store.worker_state import WorkerState  # noqa: E402

GIB = 1 << 30


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def build(n_devices: int, n_runners: int, n_models: int, rng: random.Random) -> Snapshot:
    devices = [
        DeviceState(f"vgpu:h{i // 8}:{i % 8}", f"w{i // 8}", f"q{i}", "vgpu", 80 * GIB, 80 * GIB, 0)
        for i in range(n_devices)
    ]
    runners = []
    used = [0] * n_devices
    for r in range(n_runners):
        d = r % n_devices
        size = rng.choice([2, 4, 8]) * GIB
        used[d] += size
        runners.append(
            RunnerState(
                f"r{r}",
                f"m{rng.randrange(n_models)}",
                "c",
                {devices[d].id: size},
                "ready",
                rng.choice([0, 0, 1]),
                1e9 + r,
                r,
            )
        )
    devices = [
        DeviceState(
            d.id, d.worker, keys.device_queue(d.id), d.kind, d.total, d.reported_free, used[i]
        )
        for i, d in enumerate(devices)
    ]
    return Snapshot(devices, runners, 0)


def place_all(
    state: PlacementState,
    workers: WorkerState,
    read: Callable[[float, float], Snapshot],
    jobs: list[JobNeeds],
    devices: list[DeviceState],
    tag: str,
) -> tuple[list[float], list[float]]:
    """Snapshot, decide and reserve for each job; a few devices heartbeat between jobs, as
    1,000 devices beating every 2 s would at ~50 placements/s."""
    e2e, snap_ms = [], []
    for i, job in enumerate(jobs):
        beats = devices[(i * 10) % len(devices) :][:10]
        workers.heartbeat({d.id: d.total for d in beats})
        started = time.perf_counter()
        view = read(time.time(), 1e9)
        snap_ms.append((time.perf_counter() - started) * 1000)
        decision = decide(job, view, "binpack", time.time(), 512, 8)
        if isinstance(decision, Load):
            fields = {"model": job.model, "config_key": "c"}
            state.reserve(
                f"{tag}{i}", f"p{tag}{i}", decision.reservations, fields, time.time(), 1e9
            )
        elif isinstance(decision, Route):
            state.assign(decision.runner_id, f"p{tag}{i}", time.time())
        e2e.append((time.perf_counter() - started) * 1000)
    return e2e, snap_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--runners", type=int, default=5000)
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(1)
    n_models = args.runners // 10
    snap = build(args.devices, args.runners, n_models, rng)
    jobs = [
        JobNeeds(f"m{rng.randrange(n_models * 2)}", "c", rng.choice([2, 4, 8]) * GIB)
        for _ in range(args.decisions)
    ]
    pure = []
    kinds: dict[str, int] = {}
    for job in jobs:
        started = time.perf_counter()
        decision = decide(job, snap, "binpack", 0.0, 512, 8)
        pure.append((time.perf_counter() - started) * 1000)
        kinds[type(decision).__name__] = kinds.get(type(decision).__name__, 0) + 1

    fresh = []  # a new snapshot per decision: its indexes are built inside the timing
    for job in jobs[: max(50, args.decisions // 10)]:
        view = Snapshot(snap.devices, snap.runners, 0)
        started = time.perf_counter()
        decide(job, view, "binpack", 0.0, 512, 8)
        fresh.append((time.perf_counter() - started) * 1000)

    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="ggufq-scale-")))
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        state, workers = PlacementState(client), WorkerState(client)
        now = time.time()
        for d in snap.devices:
            workers.register_device(
                DeviceInfo(d.id, "h", d.worker, "v", "vgpu", d.total, d.total, True)
            )
        for r in snap.runners:
            ((dev, size),) = r.devices.items()
            state.reserve(
                r.id, f"p{r.id}", {dev: size}, {"model": r.model, "config_key": "c"}, now, 1e9
            )
        n_e2e = max(50, args.decisions // 20)
        cache = SnapshotCache(client)
        cache.snapshot(time.time(), 1e9)  # the first read loads everything
        e2e, snap_ms = place_all(state, workers, cache.snapshot, jobs[:n_e2e], snap.devices, "c")
        full, full_snap_ms = place_all(state, workers, state.snapshot, jobs[:20], snap.devices, "f")
        client.close()
    finally:
        server.stop()

    rows = {
        "decision_p50_ms": statistics.median(pure),
        "decision_fresh_snapshot_p50_ms": statistics.median(fresh),
        "decision_p95_ms": pct(pure, 0.95),
        "e2e_p50_ms": statistics.median(e2e),
        "e2e_p95_ms": pct(e2e, 0.95),
        "snapshot_p50_ms": statistics.median(snap_ms),
        "full_read_e2e_p50_ms": statistics.median(full),
        "full_read_snapshot_p50_ms": statistics.median(full_snap_ms),
    }
    for key, value in rows.items():
        print(f"{key:32}{value:10.2f}")
    print(f"decisions: {kinds}; {args.devices} devices, {args.runners} runners")
    met = rows["decision_p50_ms"] <= 1 and rows["e2e_p50_ms"] <= 3
    print(f"targets (decision p50 <= 1 ms, end to end p50 <= 3 ms): {'met' if met else 'NOT met'}")
    print(
        json.dumps(
            {
                "bench": "placement_scale",
                "devices": args.devices,
                "runners": args.runners,
                **rows,
                "targets_met": met,
            }
        )
    )


if __name__ == "__main__":
    main()

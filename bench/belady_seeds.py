"""Loads against Belady's victims over many traces: bench/scheduling_sim.py's scenario d
(bench/cache_sim.py's trace and simulator, through the real decision) on seeds 1..N, each
judged by its worst seed.

Per seed and per max_replicas (1, 3), the loads of:

- ``ggufq``: today's rule (on each device idle runners in eviction order until the job
  fits; the device whose set costs least: fitting.victims_cost, the demand the set
  brings back);
- ``fewest``: the rule before it, the same order but the device with the fewest victims
  (the baseline, in the same run);
- ``belady``: the reference the target is set on: Belady's order (the runner needed again
  furthest away first), the device with the fewest victims;
- ``belady+``: a stronger offline reference, Belady's order and the device whose soonest
  needed victim is needed latest. Neither is a lower bound for this greedy eviction.

    python bench/belady_seeds.py [--seeds 20]

Target (issue 39): ggufq <= 1.15 x belady on every seed. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cache_sim, scheduling_sim  # noqa: E402
from scheduler.cluster import DeviceState, RunnerState, Snapshot  # noqa: E402
from scheduler.placement import decision, fitting  # noqa: E402
from scheduler.placement.needs import JobNeeds  # noqa: E402

Rating = Callable[[fitting.VictimKey | None], fitting.VictimsCost]


@contextmanager
def rating(rate: Rating) -> Iterator[None]:
    """The victims chosen among devices by ``rate(the victim key)``, for a new runner and
    for a new replica alike."""
    plain = fitting.cheapest_victims

    def cheapest(
        job: Any,
        snap: Snapshot,
        max_loaded: int,
        key: fitting.VictimKey | None,
        devices: Any = None,
        allowed: Any = None,
    ) -> list[str]:
        return plain(job, snap, max_loaded, key, devices, allowed, cost=rate(key))

    for module in (decision, fitting):
        setattr(module, "cheapest_victims", cheapest)  # noqa: B010
    try:
        yield
    finally:
        for module in (decision, fitting):
            setattr(module, "cheapest_victims", plain)  # noqa: B010


def fewest(_key: fitting.VictimKey | None) -> fitting.VictimsCost:
    return fitting.by_count


def latest_needed(key: fitting.VictimKey | None) -> fitting.VictimsCost:
    """Belady's rating of a set: when its soonest needed victim is needed again (later is
    cheaper: the key is minus that time), then how many."""
    assert key is not None

    def cost(chosen: list[RunnerState], _snap: Snapshot) -> tuple[float, ...]:
        return (max(key(r) for r in chosen), float(len(chosen)))

    return cost


def rule_runs(seed: int, max_replicas: int) -> dict[str, int]:
    models, jobs = cache_sim.trace(4000, seed)
    sim = scheduling_sim.DemandForAll
    out = {}
    with scheduling_sim.cache_sim_replicas(max_replicas):
        out["ggufq"] = sim(models, jobs, "ggufq").run()["loads"]
        with rating(fewest):
            out["fewest"] = sim(models, jobs, "ggufq").run()["loads"]
        out["belady"] = sim(models, jobs, "belady").run()["loads"]
        with rating(latest_needed):
            out["belady+"] = sim(models, jobs, "belady").run()["loads"]
    return out


def eviction_ms(devices: int = 1000, idle: int = 4, repeats: int = 15) -> dict[str, float]:
    """What the rating costs a decision: the median ms of one eviction choice over
    ``devices`` full GPUs of ``idle`` idle runners each (every model's own), a job that
    needs two of them gone, rated by victims_cost against by the fewest, each on a
    snapshot of its own (as each decision is: its indexes, the mean demand, built in the
    time counted)."""
    gib = 1 << 30
    devs, runners, demand = [], [], {}
    for d in range(devices):
        devs.append(DeviceState(f"d{d}", "w", f"d{d}", "gpu", 16 * gib, 16 * gib, 16 * gib))
        for k in range(idle):
            model = f"m{d}-{k}"
            runners.append(
                RunnerState(
                    f"r{d}-{k}", model, "c", {f"d{d}": 4 * gib}, "ready", 0, 100.0 + k, 50.0
                )
            )
            demand[model] = (d * 7 + k * 13) % 97 / 10
    job = JobNeeds("new", "c", 6 * gib)
    out = {}
    for name, cost in (("fewest", fewest(None)), ("victims_cost", None)):
        times = []
        for _ in range(repeats):
            snap = Snapshot(devs, runners, 0, demand=demand)  # a decision's own, indexes and all
            started = time.perf_counter()
            fitting.cheapest_victims(job, snap, 10, None, cost=cost)
            times.append((time.perf_counter() - started) * 1000)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    began = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    print(
        f"{'seed':>4} {'reps':>4} {'ggufq':>6} {'fewest':>6} {'belady':>6} {'belady+':>7}"
        f" {'ggufq/b':>7} {'fewest/b':>8} {'ggufq/b+':>8} {'fewest/b+':>9}"
    )
    for seed in range(1, args.seeds + 1):
        for n in (1, 3):
            loads = rule_runs(seed, n)
            ratios = {
                f"{rule}/{ref}": loads[rule] / loads[ref]
                for rule in ("ggufq", "fewest")
                for ref in ("belady", "belady+")
            }
            rows[f"{seed}/{n}"] = loads | ratios
            print(
                f"{seed:>4} {n:>4} {loads['ggufq']:>6} {loads['fewest']:>6} "
                f"{loads['belady']:>6} {loads['belady+']:>7} "
                f"{ratios['ggufq/belady']:>7.3f} {ratios['fewest/belady']:>8.3f} "
                f"{ratios['ggufq/belady+']:>8.3f} {ratios['fewest/belady+']:>9.3f}",
                flush=True,
            )
    summary = {}
    for n in (1, 3):
        for ratio in ("ggufq/belady", "fewest/belady", "ggufq/belady+", "fewest/belady+"):
            values = [r[ratio] for k, r in rows.items() if k.endswith(f"/{n}")]
            summary[f"replicas_{n} {ratio}"] = {
                "worst": max(values),
                "median": statistics.median(values),
            }
    print()
    for name, s in summary.items():
        print(f"{name:28} worst {s['worst']:.3f}  median {s['median']:.3f}")
    worst = max(summary[f"replicas_{n} ggufq/belady"]["worst"] for n in (1, 3))
    timing = eviction_ms()
    print(
        f"one eviction choice over 1,000 devices x 4 idle runners: {timing['victims_cost']:.2f} ms"
        f" (fewest: {timing['fewest']:.2f} ms)"
    )
    print(
        f"worst ggufq / belady over {args.seeds} seeds = {worst:.3f} (target <= 1.15): "
        f"{'met' if worst <= 1.15 else 'NOT met'}"
    )
    print(
        json.dumps(
            {
                "bench": "belady_seeds",
                "seeds": args.seeds,
                "worst_loads_vs_belady": worst,
                "eviction_ms": timing,
                "summary": summary,
                "runs": rows,
                "elapsed_s": time.perf_counter() - began,
            }
        )
    )


if __name__ == "__main__":
    main()

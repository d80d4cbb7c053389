"""Model loads under a multi-model workload, replayed through the real decision function.

A synthetic trace (Zipf mix over a dozen models of different sizes, Poisson arrivals,
exponential job durations) runs on a simulated clock against a few devices. Victims for
eviction are chosen by: ggufq's rule (least decayed demand for the model, then soonest
expiry, then least recently used; demand recorded per request as placement does), Ollama's
(idle runners, shortest keep_alive first: with one keep_alive for all, arbitrary), LRU, and
Belady's offline optimum (the idle runner whose model is needed again furthest in the
future: a lower bound on loads for this greedy eviction).

    python bench/cache_sim.py [--jobs 4000] [--seed 1]

Targets: loads <= 1.15 × Belady, and fewer than Ollama's rule. Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.cluster import DeviceState, RunnerState, Snapshot, decayed  # noqa: E402
from scheduler.placement.decision import decide  # noqa: E402
from scheduler.placement.fitting import VictimKey  # noqa: E402
from scheduler.placement.needs import JobNeeds  # noqa: E402
from scheduler.placement.verdict import Evict, Load, Route  # noqa: E402

GIB = 1 << 30
KEEP_ALIVE = 300.0
LOAD_S_PER_GIB = 0.5


def trace(n: int, seed: int) -> tuple[dict[str, int], list[tuple[float, str, float]]]:
    rng = random.Random(seed)
    models = {f"m{i:02d}": rng.choice([2, 3, 4, 6, 8, 12]) * GIB for i in range(12)}
    names = sorted(models)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(names))]
    rng.shuffle(names)
    t, jobs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(0.6)
        jobs.append((t, rng.choices(names, weights)[0], rng.expovariate(1 / 4.0)))
    return models, jobs


class CacheSim:
    """One replay of the trace under one eviction rule, on a simulated clock."""

    TOTALS = {"d0": 16 * GIB, "d1": 16 * GIB, "d2": 24 * GIB}

    def __init__(self, models: dict[str, int], jobs: list[tuple[float, str, float]], rule: str):
        self.models, self.jobs, self.rule = models, jobs, rule
        self.uses: dict[str, list[float]] = {}
        for t, m, _ in jobs:
            self.uses.setdefault(m, []).append(t)
        self.runners: dict[str, RunnerState] = {}
        self.busy_until: dict[str, float] = {}
        self.loads = self.evictions = self.counter = 0
        self.waits: list[float] = []
        self.waiting: list[tuple[float, str, float]] = []
        self.completions: list[tuple[float, str]] = []
        self.demand: dict[str, tuple[float, float]] = {}  # what placement records per request

    def key_for(self, now: float) -> VictimKey | None:
        if self.rule == "ggufq":
            return None
        if self.rule == "lru":
            return lambda r: r.last_used
        if self.rule == "ollama":
            return lambda r: (KEEP_ALIVE, r.id)  # equal keep_alive: first found

        def next_use(r: RunnerState) -> float:  # Belady: needed again furthest away first
            times = self.uses[r.model]
            i = bisect.bisect_right(times, now)
            return -(times[i] if i < len(times) else float("inf"))

        return next_use

    def count_request(self, model: str, now: float) -> None:
        score, last = self.demand.get(model, (0.0, now))
        self.demand[model] = (decayed(score, last, now) + 1, now)

    def snapshot(self, now: float) -> Snapshot:
        reserved = {d: 0 for d in self.TOTALS}
        for r in self.runners.values():
            for d, b in r.devices.items():
                reserved[d] += b
        devices = [
            DeviceState(d, "w", d, "vgpu", t, t, reserved[d]) for d, t in self.TOTALS.items()
        ]
        scores = {m: decayed(s, last, now) for m, (s, last) in self.demand.items()}
        demand = scores if self.rule == "ggufq" else {}
        return Snapshot(devices, list(self.runners.values()), demand=demand)

    def try_place(self, now: float, arrived: float, model: str, duration: float) -> bool:
        job = JobNeeds(model, "c", self.models[model])
        for _ in range(10):
            decision = decide(job, self.snapshot(now), "binpack", now, 10**6, 3, self.key_for(now))
            match decision:
                case Route(rid, _):
                    start = max(now, self.busy_until[rid])
                case Load(dev, nbytes):
                    rid, start = self.load(model, dev, nbytes, now)
                case Evict(ids):
                    self.evict(ids)
                    continue
                case _:
                    return False
            r = self.runners[rid]
            self.runners[rid] = replace(r, in_flight=r.in_flight + 1, expires_at=-1)
            self.busy_until[rid] = start + duration
            heapq.heappush(self.completions, (start + duration, rid))
            self.waits.append(start - arrived)
            return True
        return False

    def load(self, model: str, dev: str, nbytes: int, now: float) -> tuple[str, float]:
        self.counter += 1
        rid = f"r{self.counter}"
        self.runners[rid] = RunnerState(rid, model, "c", {dev: nbytes}, "ready", 0, -1, now)
        self.busy_until[rid] = now + nbytes / GIB * LOAD_S_PER_GIB
        self.loads += 1
        return rid, self.busy_until[rid]

    def evict(self, ids: list[str]) -> None:
        for rid in ids:
            self.runners.pop(rid)
            self.busy_until.pop(rid)
            self.evictions += 1

    def complete_until(self, t: float) -> None:
        while self.completions and self.completions[0][0] <= t:
            at, rid = heapq.heappop(self.completions)
            r = self.runners[rid]
            left = r.in_flight - 1
            expires = at + KEEP_ALIVE if left == 0 else -1
            self.runners[rid] = replace(r, in_flight=left, last_used=at, expires_at=expires)
            for rid2, r2 in list(self.runners.items()):  # keep_alive expiries
                if r2.in_flight == 0 and 0 <= r2.expires_at <= at:
                    self.runners.pop(rid2)
                    self.busy_until.pop(rid2)
            self.waiting[:] = [w for w in self.waiting if not self.try_place(at, *w)]

    def run(self) -> dict:
        for arrived, model, duration in self.jobs:
            self.complete_until(arrived)
            self.count_request(model, arrived)
            if self.waiting or not self.try_place(arrived, arrived, model, duration):
                self.waiting.append((arrived, model, duration))
        self.complete_until(float("inf"))
        return {
            "loads": self.loads,
            "evictions": self.evictions,
            "served": len(self.waits),
            "mean_wait_s": sum(self.waits) / max(1, len(self.waits)),
        }


def simulate(models: dict[str, int], jobs: list[tuple[float, str, float]], rule: str) -> dict:
    return CacheSim(models, jobs, rule).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    models, jobs = trace(args.jobs, args.seed)
    results = {rule: simulate(models, jobs, rule) for rule in ("ggufq", "ollama", "lru", "belady")}
    print(f"{'rule':12}{'loads':>8}{'evictions':>11}{'served':>8}{'mean wait s':>13}")
    for rule, r in results.items():
        print(f"{rule:12}{r['loads']:8}{r['evictions']:11}{r['served']:8}{r['mean_wait_s']:13.2f}")
    ratio = results["ggufq"]["loads"] / max(1, results["belady"]["loads"])
    met = ratio <= 1.15 and results["ggufq"]["loads"] < results["ollama"]["loads"]
    print(
        f"ggufq loads / Belady = {ratio:.3f}; target (<= 1.15 and fewer than Ollama's rule): "
        f"{'met' if met else 'NOT met'}"
    )
    print(
        json.dumps(
            {
                "bench": "cache_sim",
                "jobs": args.jobs,
                "seed": args.seed,
                **{f"{rule}_{k}": v for rule, r in results.items() for k, v in r.items()},
                "ratio_to_belady": ratio,
                "target_met": met,
            }
        )
    )


if __name__ == "__main__":
    main()

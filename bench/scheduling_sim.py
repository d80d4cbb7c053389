"""Replicas, fair shares and prefix-affine routing, replayed through the real decision.

A discrete-event simulation on a simulated clock (it never sleeps). Placement calls the
real ``decide()`` on a snapshot of the simulated cluster and carries the answer out as the
service does (route; load a runner; unload idle runners and park the job; park; refuse);
parked jobs are retried in ``fair_order`` whenever capacity may have freed; a runner
admits its jobs through the worker's real ``Admission`` (fair across tenants, into the
slot that holds the most of the prompt). Loads take 0.5 s per GiB, runners unload after
keep_alive, a slot keeps the KV cache of the sequence it served last; a job's time is its
prompt's uncached tokens at PREFILL_TPS plus its decoding time (slots do not slow down
each other).

    python bench/scheduling_sim.py [--seed 1]

a. Bursts on one hot model beside four cold ones, 4 GPUs: the hot model's p50/p95 wait
   and the GPUs' busy share (time with a job running) with replicas (max_replicas 4)
   against without (1), same trace. Target: p95 wait <= 1/2.
b. Two tenants on one model with two replicas: 'heavy' floods batch jobs, 'light' sends
   interactive ones. Light's p95 latency (arrival to last token) with the flood against
   alone, with fair order and queue_depth 1 (waiting work parks, in fair order), and with
   today's FIFO (every job queued at a worker). Target: <= 1.5x alone. Light alone never
   waits (its p95 wait is 0), so the ratio is taken on latency; the table shows waits.
c. Multi-turn chats on 4 replicas: prompt tokens evaluated with affinity against without
   (a turn reuses its conversation's cache only in the slot that served the turn before).
   Target: >= 40 % fewer.
d. Loads against Belady's victims, on bench/cache_sim.py's trace and simulator, without
   and with replicas (up to 3). Target: <= 1.15x.

Prints a table per scenario, then one JSON line.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cache_sim  # noqa: E402
from scheduler.cluster import DeviceState, RunnerState, Snapshot, decayed  # noqa: E402
from scheduler.fairness import fair_order  # noqa: E402
from scheduler.placement.affinity import AffinityMap, chat_key  # noqa: E402
from scheduler.placement.decision import decide  # noqa: E402
from scheduler.placement.needs import JobNeeds  # noqa: E402
from scheduler.placement.verdict import Evict, Load, Park, Route  # noqa: E402
from workers.engine.batching import Admission, by_reuse  # noqa: E402

GIB = 1 << 30
LOAD_S_PER_GIB = 0.5  # as bench/cache_sim.py
UNLOAD_S = 1.0
PREFILL_TPS = 2000.0  # prompt tokens per second and slot
DECODE_TPS = 30.0  # generated tokens per second and slot


@dataclass
class Job:
    model: str
    arrival: float
    work_s: float  # decoding time
    tenant: str = "default"
    priority: str = "interactive"
    prompt: int = 0  # prompt tokens
    answer: int = 0  # generated tokens (the slot's cache keeps prompt and answer)
    conv: int = -1  # conversation, -1 for none
    reusable: int = 0  # prompt tokens the turn before left in a slot's cache
    key: str | None = None  # prefix key for affinity
    start: float = -1.0
    end: float = -1.0
    evaluated: int = 0


@dataclass
class Runner:
    id: str
    model: str
    device: str
    nbytes: int
    slots: int
    admission: Admission[Job]
    state: str = "loading"
    in_flight: int = 0
    expires_at: float = -1.0
    last_used: float = 0.0
    cache: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot → (conv, tokens)


@dataclass(frozen=True)
class Setup:
    devices: dict[str, int]
    models: dict[str, int]
    max_replicas: int = 1
    min_replicas: int = 0
    queue_depth: int = -1
    fair: bool = True
    affinity: bool = False
    keep_alive_s: float = 300.0
    num_parallel: int = 4


class Sim:
    """One replay of a workload on a simulated cluster."""

    def __init__(self, setup: Setup) -> None:
        self.s, self.now, self.seq = setup, 0.0, 0
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.runners: dict[str, Runner] = {}
        self.parked: list[Job] = []
        self.done: list[Job] = []
        self.demand: dict[str, tuple[float, float]] = {}
        self.affinity = AffinityMap()
        self.loads = self.evictions = self.refused = self.counter = 0
        self.busy_s = dict.fromkeys(setup.devices, 0.0)
        self.running = dict.fromkeys(setup.devices, 0)
        self.changed_at = dict.fromkeys(setup.devices, 0.0)
        # a conversation's next turn, asked for when a turn ends
        self.next_turn: Callable[[Sim, Job], Job | None] = lambda _sim, _job: None

    def at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def run(self, jobs: list[Job]) -> Sim:
        for job in jobs:
            self.at(job.arrival, "arrive", job)
        while self.events:
            self.now, _, kind, args = heapq.heappop(self.events)
            getattr(self, "on_" + kind)(*args)
        return self

    # -- events ------------------------------------------------------------------------
    def on_arrive(self, job: Job) -> None:
        score, last = self.demand.get(job.model, (0.0, self.now))
        self.demand[job.model] = (decayed(score, last, self.now) + 1, self.now)
        if not self.place(job, retry=False):
            self.parked.append(job)

    def on_loaded(self, runner: Runner) -> None:
        runner.state = "ready"
        self.admit(runner)

    def on_finish(self, runner: Runner, slot: int, job: Job) -> None:
        job.end = self.now
        self.done.append(job)
        self.count_running(runner.device, -1)
        runner.cache[slot] = (job.conv, job.prompt + job.answer)
        runner.admission.release(slot)
        runner.in_flight -= 1
        runner.last_used = self.now
        if self.s.affinity and job.key is not None:
            self.affinity.put(job.key, runner.id)
        if runner.in_flight == 0:
            runner.expires_at = self.now + self.s.keep_alive_s
            self.at(runner.expires_at, "expire", runner, runner.expires_at)
        self.admit(runner)
        turn = self.next_turn(self, job)
        if turn is not None:
            self.at(turn.arrival, "arrive", turn)
        self.retry_parked()

    def on_expire(self, runner: Runner, stamp: float) -> None:
        if runner.state == "ready" and runner.in_flight == 0 and runner.expires_at == stamp:
            self.unload(runner)

    def on_unloaded(self, runner: Runner) -> None:
        del self.runners[runner.id]
        self.affinity.forget_runner(runner.id)
        self.retry_parked()

    # -- placement, as the service does it ---------------------------------------------
    def place(self, job: Job, retry: bool) -> bool:
        """Decide and carry out; False when the job parks."""
        s = self.s
        affine = self.affinity.get(job.key) if s.affinity and job.key else None
        needs = JobNeeds(job.model, "c", s.models[job.model], max_replicas=s.max_replicas)
        needs = replace(needs, min_replicas=s.min_replicas, queue_depth=s.queue_depth)
        needs = replace(needs, affine=affine, retry=retry)
        match decide(needs, self.snapshot(), "binpack", self.now, 10**9, 3):
            case Route(runner_id, _):
                self.assign(self.runners[runner_id], job)
            case Load(device, nbytes):
                self.assign(self.load(job.model, device, nbytes), job)
            case Evict(victims):
                for runner_id in victims:
                    self.unload(self.runners[runner_id])
                    self.evictions += 1
                return False
            case Park():
                return False
            case _:
                self.refused += 1
        return True

    def retry_parked(self) -> None:
        if self.s.fair:
            keys = [(j.tenant, j.priority, j.arrival) for j in self.parked]
            order = [self.parked[i] for i in fair_order(keys)]
        else:
            order = sorted(self.parked, key=lambda j: j.arrival)
        still, stuck = [], set()
        for job in order:
            if job.model in stuck or not self.place(job, retry=True):
                stuck.add(job.model)  # as placement: its later jobs wait for the next event
                still.append(job)
        self.parked = still

    def snapshot(self) -> Snapshot:
        reserved = dict.fromkeys(self.s.devices, 0)
        for r in self.runners.values():
            reserved[r.device] += r.nbytes
        devices = [
            DeviceState(d, "w", d, "gpu", total, total, reserved[d])
            for d, total in self.s.devices.items()
        ]
        runners = [
            RunnerState(
                r.id,
                r.model,
                "c",
                {r.device: r.nbytes},
                r.state,  # type: ignore[arg-type]
                r.in_flight,
                r.expires_at if r.in_flight == 0 else -1.0,
                r.last_used,
                r.slots,
            )
            for r in self.runners.values()
        ]
        demand = {m: decayed(s, last, self.now) for m, (s, last) in self.demand.items()}
        models = {j.model for j in self.parked}
        return Snapshot(devices, runners, len(self.parked), demand, models)

    # -- runners and slots -------------------------------------------------------------
    def load(self, model: str, device: str, nbytes: int) -> Runner:
        self.counter += 1
        self.loads += 1
        classify = (lambda j: (j.tenant, j.priority, 1.0)) if self.s.fair else None
        admission: Admission[Job] = Admission(self.s.num_parallel, classify)
        runner = Runner(f"r{self.counter}", model, device, nbytes, self.s.num_parallel, admission)
        self.runners[runner.id] = runner
        self.at(self.now + nbytes / GIB * LOAD_S_PER_GIB, "loaded", runner)
        return runner

    def unload(self, runner: Runner) -> None:
        runner.state = "unloading"
        self.at(self.now + UNLOAD_S, "unloaded", runner)

    def assign(self, runner: Runner, job: Job) -> None:
        runner.in_flight += 1
        runner.expires_at = -1.0
        runner.admission.push(job)
        if runner.state == "ready":
            self.admit(runner)

    def admit(self, runner: Runner) -> None:
        def reuse(job: Job, slot: int) -> int:
            conv, tokens = runner.cache.get(slot, (-1, 0))
            return tokens if job.conv >= 0 and conv == job.conv else 0

        for job, slot in runner.admission.admit(by_reuse(reuse)):
            job.start = self.now
            job.evaluated = job.prompt - reuse(job, slot)
            self.count_running(runner.device, +1)
            service = job.evaluated / PREFILL_TPS + job.work_s
            self.at(self.now + service, "finish", runner, slot, job)

    def count_running(self, device: str, delta: int) -> None:
        if self.running[device]:
            self.busy_s[device] += self.now - self.changed_at[device]
        self.running[device] += delta
        self.changed_at[device] = self.now


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def waits(jobs: list[Job], tenant: str | None = None) -> list[float]:
    return [j.start - j.arrival for j in jobs if tenant in (None, j.tenant)]


def latencies(jobs: list[Job], tenant: str) -> list[float]:
    return [j.end - j.arrival for j in jobs if j.tenant == tenant]


# -- a. replicas of a hot model --------------------------------------------------------------

GPUS4 = {f"gpu{i}": 24 * GIB for i in range(4)}


def bursty(rng: random.Random) -> tuple[dict[str, int], list[Job]]:
    """60 jobs in 20 s on 'hot' every 3 minutes for an hour; each cold model gets a job
    every 90 s on average."""
    models = {"hot": 8 * GIB} | {f"cold{i}": (8 + 2 * i) * GIB for i in range(4)}
    jobs = [
        Job("hot", 60.0 + 180.0 * burst + rng.uniform(0, 20), rng.lognormvariate(1.4, 0.5))
        for burst in range(20)
        for _ in range(60)
    ]
    for i in range(4):
        t = rng.expovariate(1 / 90)
        while t < 3660:
            jobs.append(Job(f"cold{i}", t, rng.lognormvariate(1.4, 0.5)))
            t += rng.expovariate(1 / 90)
    return models, sorted(jobs, key=lambda j: j.arrival)


def replicas(seed: int) -> dict[str, Any]:
    models, jobs = bursty(random.Random(seed))
    out: dict[str, Any] = {}
    for n in (1, 4):
        setup = Setup(GPUS4, models, max_replicas=n, keep_alive_s=60.0)
        sim = Sim(setup).run([replace(j) for j in jobs])
        hot = [j for j in sim.done if j.model == "hot"]
        span = max(j.end for j in sim.done) - jobs[0].arrival
        out[f"max_replicas_{n}"] = {
            "hot_p50_wait_s": pct(waits(hot), 0.5),
            "hot_p95_wait_s": pct(waits(hot), 0.95),
            "all_p95_wait_s": pct(waits(sim.done), 0.95),
            "gpu_busy_share": sum(sim.busy_s.values()) / (len(GPUS4) * span),
            "loads": sim.loads,
            "evictions": sim.evictions,
            "served": len(sim.done),
            "refused": sim.refused,
        }
    one, four = out["max_replicas_1"], out["max_replicas_4"]
    out["ratio"] = four["hot_p95_wait_s"] / max(1e-9, one["hot_p95_wait_s"])
    return out


# -- b. fair shares per tenant ---------------------------------------------------------------


def tenants(rng: random.Random, heavy: bool) -> list[Job]:
    """Two warm-up jobs load both replicas; 'light' sends an interactive job every 5 s on
    average for 10 minutes; 'heavy' submits 1,500 batch jobs in the first 5 minutes, more
    than the cluster serves, so that a backlog builds up."""
    jobs = [Job("chat", 0.0, 0.0, "ops"), Job("chat", 0.0, 0.0, "ops")]
    t = 30.0
    while t < 630:
        jobs.append(Job("chat", t, rng.lognormvariate(1.5, 0.6), "light", "interactive"))
        t += rng.expovariate(1 / 5)
    for _ in range(1500 if heavy else 0):
        work = rng.lognormvariate(0.9, 0.4)
        jobs.append(Job("chat", 30.0 + rng.uniform(0, 300), work, "heavy", "batch"))
    return sorted(jobs, key=lambda j: j.arrival)


def fairness(seed: int) -> dict[str, Any]:
    two = {"gpu0": 24 * GIB, "gpu1": 24 * GIB}
    fair = Setup(two, {"chat": 8 * GIB}, max_replicas=2, min_replicas=2, queue_depth=1)
    fifo = replace(fair, queue_depth=-1, fair=False)
    out: dict[str, Any] = {}
    for name, setup, heavy in (("alone", fair, False), ("fair", fair, True), ("fifo", fifo, True)):
        done = Sim(setup).run(tenants(random.Random(seed), heavy)).done
        out[name] = {
            "light_p95_latency_s": pct(latencies(done, "light"), 0.95),
            "light_p95_wait_s": pct(waits(done, "light"), 0.95),
            "light_max_wait_s": max(waits(done, "light")),
            "heavy_p95_wait_s": pct(waits(done, "heavy"), 0.95),
            "served": len(done),
        }
    flood = [j.work_s for j in tenants(random.Random(seed), True) if j.tenant == "heavy"]
    out["heavy_mean_job_s"] = sum(flood) / len(flood)
    alone = out["alone"]["light_p95_latency_s"]
    out["ratio"] = out["fair"]["light_p95_latency_s"] / alone
    out["fifo_ratio"] = out["fifo"]["light_p95_latency_s"] / alone
    return out


# -- c. prefix-affine routing ----------------------------------------------------------------


class Msg(NamedTuple):
    role: str
    content: str


@dataclass
class Conversation:
    id: int
    system: int  # tokens
    turns: list[tuple[int, int]]  # (user tokens, answer tokens)
    think_s: list[float]
    history: int = 0  # tokens of the conversation so far
    served: int = 0


def chats(rng: random.Random, n: int = 60) -> tuple[list[Conversation], list[Job]]:
    """Conversations start over 15 minutes; each has 3 to 10 turns, the user thinking
    20 s on average between an answer and the next question."""
    convs, first, t = [], [], 0.0
    for c in range(n):
        t += rng.expovariate(1 / 15)
        turns = [(rng.randint(20, 300), rng.randint(50, 400)) for _ in range(rng.randint(3, 10))]
        think = [rng.expovariate(1 / 20) for _ in turns]
        convs.append(Conversation(c, rng.randint(200, 800), turns, think))
        first.append(turn_job(convs[-1], t))
    return convs, first


def turn_job(conv: Conversation, at: float) -> Job:
    user, answer = conv.turns[conv.served]
    reusable = conv.history  # 0 on the first turn
    prompt = (conv.history or conv.system) + user
    conv.history = prompt + answer
    first = [Msg("system", f"system prompt {conv.id}"), Msg("user", f"question {conv.id}")]
    job = Job("chat", at, answer / DECODE_TPS, prompt=prompt, answer=answer, conv=conv.id)
    job.key, job.reusable = chat_key(first, scope="chat"), reusable
    return job


def next_turn(convs: list[Conversation], sim: Sim, job: Job) -> Job | None:
    conv = convs[job.conv]
    conv.served += 1
    if conv.served == len(conv.turns):
        return None
    return turn_job(conv, sim.now + conv.think_s[conv.served])


def affinity(seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, on in (("without", False), ("with", True)):
        convs, first = chats(random.Random(seed))
        sim = Sim(Setup(GPUS4, {"chat": 8 * GIB}, 4, 4, affinity=on))
        sim.next_turn = partial(next_turn, convs)
        done = sim.run(first).done
        out[name] = {
            "prompt_tokens": sum(j.prompt for j in done),
            "evaluated_tokens": sum(j.evaluated for j in done),
            "evaluated_if_every_turn_reused": sum(j.prompt - j.reusable for j in done),
            "turns": len(done),
            "p95_wait_s": pct(waits(done), 0.95),
        }
    without = out["without"]["evaluated_tokens"]
    out["saved_share"] = 1 - out["with"]["evaluated_tokens"] / without
    out["best_saved_share"] = 1 - out["with"]["evaluated_if_every_turn_reused"] / without
    return out


# -- d. loads against Belady -----------------------------------------------------------------


@contextmanager
def cache_sim_replicas(max_replicas: int) -> Iterator[None]:
    """bench/cache_sim.py's simulator, its jobs allowed ``max_replicas`` runners."""
    plain = cache_sim.JobNeeds
    setattr(cache_sim, "JobNeeds", partial(JobNeeds, max_replicas=max_replicas))  # noqa: B010
    try:
        yield
    finally:
        setattr(cache_sim, "JobNeeds", plain)  # noqa: B010


class DemandForAll(cache_sim.CacheSim):
    """cache_sim's simulator with the demand counts in every rule's snapshot: with
    replicas the decision reads them (branch 3d) whatever orders the victims, so Belady's
    run must see them too to differ from ours in its victims only."""

    def snapshot(self, now: float) -> Snapshot:
        scores = {m: decayed(s, last, now) for m, (s, last) in self.demand.items()}
        return replace(super().snapshot(now), demand=scores)


def belady(seed: int) -> dict[str, Any]:
    models, jobs = cache_sim.trace(4000, seed)
    out: dict[str, Any] = {}
    for n in (1, 3):
        with cache_sim_replicas(n):
            ours = DemandForAll(models, jobs, "ggufq").run()
            best = DemandForAll(models, jobs, "belady").run()
        out[f"max_replicas_{n}"] = {
            "loads": ours["loads"],
            "belady_loads": best["loads"],
            "ratio": ours["loads"] / max(1, best["loads"]),
            "mean_wait_s": ours["mean_wait_s"],
        }
    out["ratio"] = max(r["ratio"] for r in out.values())
    return out


# -- report ----------------------------------------------------------------------------------


def table(title: str, rows: dict[str, dict[str, Any]], columns: list[str]) -> None:
    print(title)
    width = [max(len(c), 9) + 2 for c in columns]
    print(" " * 16 + "".join(f"{c:>{w}}" for c, w in zip(columns, width, strict=True)))
    for name, row in rows.items():
        cells = [row[c] for c in columns]
        text = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells]
        print(f"{name:16}" + "".join(f"{t:>{w}}" for t, w in zip(text, width, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    began = time.perf_counter()
    a, b, c, d = replicas(args.seed), fairness(args.seed), affinity(args.seed), belady(args.seed)
    runs_a = {k: v for k, v in a.items() if k != "ratio"}
    cols = ["hot_p50_wait_s", "hot_p95_wait_s", "gpu_busy_share", "loads", "evictions"]
    table("a. bursts on one hot model, 4 GPUs, same trace", runs_a, cols)
    print(f"hot p95 wait with / without replicas = {a['ratio']:.3f} (target <= 0.5)\n")
    runs_b = {k: b[k] for k in ("alone", "fair", "fifo")}
    cols = ["light_p95_latency_s", "light_p95_wait_s", "light_max_wait_s", "heavy_p95_wait_s"]
    table("b. light's interactive jobs beside heavy's batch flood, 2 replicas", runs_b, cols)
    print(
        f"light p95 latency fair / alone = {b['ratio']:.3f} (target <= 1.5); FIFO / alone = "
        f"{b['fifo_ratio']:.1f}; heavy's mean job {b['heavy_mean_job_s']:.1f} s\n"
    )
    runs_c = {k: c[k] for k in ("without", "with")}
    table("c. multi-turn chats on 4 replicas", runs_c, ["prompt_tokens", "evaluated_tokens"])
    print(
        f"evaluated tokens saved by affinity = {c['saved_share']:.1%} (target >= 40 %); "
        f"{c['best_saved_share']:.1%} if every turn found its history cached\n"
    )
    runs_d = {k: v for k, v in d.items() if k != "ratio"}
    table(
        "d. loads against Belady's victims (cache_sim's trace)", runs_d, ["loads", "belady_loads"]
    )
    print(f"worst loads / Belady = {d['ratio']:.3f} (target <= 1.15)")
    met = {
        "replicas": a["ratio"] <= 0.5,
        "fair": b["ratio"] <= 1.5,
        "affinity": c["saved_share"] >= 0.4,
        "belady": d["ratio"] <= 1.15,
    }
    print("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    figures = {"replicas": a, "fairness": b, "affinity": c, "belady": d, "targets_met": met}
    head = {
        "bench": "scheduling_sim",
        "seed": args.seed,
        "replicas_p95_ratio": a["ratio"],
        "fair_light_p95_ratio": b["ratio"],
        "affinity_saved_share": c["saved_share"],
        "loads_vs_belady": d["ratio"],
    }
    print(json.dumps(head | figures | {"elapsed_s": time.perf_counter() - began}))


if __name__ == "__main__":
    main()

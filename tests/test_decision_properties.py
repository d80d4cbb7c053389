"""Property tests: the pure decision on random snapshots, and a simulated cluster in which
several placers decide on stale snapshots and commit through an atomic re-check (as the
Lua scripts do), with random arrivals, completions, expiries and worker deaths."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster import DeviceState, RunnerState, Snapshot
from scheduler.placement.commit import Assigned, Wait, commit
from scheduler.placement.decision import decide
from scheduler.placement.fitting import first_fit, pick
from scheduler.placement.needs import GroupNeeds, JobNeeds
from scheduler.placement.verdict import Evict, Load, Park, Refuse, Route

GIB = 1 << 30
MODELS = {f"m{i}": (i % 4 + 1) * GIB for i in range(6)}  # model → bytes
# a model larger than any one device: it runs split over GPUs of one worker (branch 4)
BIG = GroupNeeds(per_block=(GIB,) * 8, per_device=GIB // 2, last=GIB)
MODELS["big"] = 8 * GIB + GIB // 2 + GIB + 4 * GIB  # bytes if it were on one device


def needs(model: str, config: str = "a") -> JobNeeds:
    return JobNeeds(model, config, MODELS[model], group=BIG if model == "big" else None)


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[Snapshot, JobNeeds]:
    devices = []
    runners = []
    for d in range(draw(st.integers(1, 4))):
        total = draw(st.integers(2, 12)) * GIB
        used = 0
        for r in range(draw(st.integers(0, 3))):
            model = draw(st.sampled_from(sorted(MODELS)))
            size = MODELS[model]
            if used + size > total:
                break
            used += size
            runners.append(
                RunnerState(
                    id=f"r{d}{r}",
                    model=model,
                    config_key=draw(st.sampled_from(["a", "b"])),
                    devices={f"d{d}": size},
                    state=draw(st.sampled_from(["loading", "ready", "unloading"])),
                    in_flight=draw(st.integers(0, 2)),
                    expires_at=draw(st.floats(-1, 100)),
                    last_used=draw(st.floats(0, 100)),
                )
            )
        free = draw(st.integers(0, total))
        devices.append(
            DeviceState(
                id=f"d{d}",
                worker="w",
                queue=f"q{d}",
                kind=draw(st.sampled_from(["gpu", "vgpu", "cpu"])),
                total=total,
                reported_free=free,
                reserved=used,
            )
        )
    model = draw(st.sampled_from(sorted(MODELS)))
    job = needs(model, draw(st.sampled_from(["a", "b"])))
    return Snapshot(devices, runners, parked=draw(st.integers(0, 5))), job


@settings(max_examples=400, deadline=None)
@given(snapshots())
def test_decision_is_always_admissible(case: tuple[Snapshot, JobNeeds]) -> None:
    snap, job = case
    decision = decide(job, snap, "binpack", now=50.0, max_queue=4, max_loaded=3)
    devices = {d.id: d for d in snap.devices}
    runners = {r.id: r for r in snap.runners}
    match decision:
        case Route(runner_id, device_id):
            r = runners[runner_id]
            assert (r.model, r.config_key) == (job.model, job.config_key)
            assert r.state != "unloading" and device_id in r.devices
        case Load() as load:
            for device_id, nbytes in load.reservations.items():
                assert devices[device_id].free >= nbytes
                live = [
                    r for r in snap.runners if r.state != "unloading" and device_id in r.devices
                ]
                assert len(live) < 3
            if load.split:
                assert job.group and sum(b for _, _, b in load.split) == len(job.group.per_block)
                assert len({devices[d].worker for d in load.reservations}) == 1
            else:
                assert load.bytes == job.bytes
        case Evict(ids):
            assert ids and all(
                runners[i].in_flight == 0 and runners[i].state != "unloading" for i in ids
            )
        case Refuse("no_capacity", _):
            assert job.bytes > max(d.total for d in snap.devices)
        case Refuse("server_busy", _):
            assert snap.parked >= 4
        case Park(_):
            assert not any(d.free >= job.bytes for d in snap.devices) or any(
                len([r for r in snap.runners if i in r.devices and r.state != "unloading"]) >= 3
                for i in devices
            )
        case _:
            raise AssertionError(decision)


@dataclass
class Cluster:
    """An in-memory :class:`Ledger`: like the Lua scripts, it re-checks capacity atomically;
    placement's own :func:`commit` carries the decisions out against it."""

    total: dict[str, int]
    alive: set[str] = field(default_factory=set)
    runners: dict[str, RunnerState] = field(default_factory=dict)
    counter: int = 0

    def reserved(self, device: str) -> int:
        return sum(r.devices.get(device, 0) for r in self.runners.values())

    def snapshot(self, parked: int) -> Snapshot:
        devices = [
            DeviceState(d, "w", d, "vgpu", t, t, self.reserved(d))
            for d, t in self.total.items()
            if d in self.alive
        ]
        live = [r for r in self.runners.values() if set(r.devices) <= self.alive]
        return Snapshot(devices, live, parked)

    def assign(self, runner_id: str, placement_id: str, now: float) -> bool:
        runner = self.runners.get(runner_id)
        if runner is None or runner.state == "unloading":
            return False
        self.runners[runner_id] = replace(runner, in_flight=runner.in_flight + 1)
        return True

    def reserve(
        self,
        runner_id: str,
        placement_id: str,
        reservations: dict[str, int],
        fields: dict[str, Any],
        now: float,
    ) -> bool:
        if not all(
            dev in self.alive and self.total[dev] - self.reserved(dev) >= nbytes
            for dev, nbytes in reservations.items()
        ):
            return False
        model, config = fields["model"], fields["config_key"]
        self.runners[runner_id] = RunnerState(
            runner_id, model, config, reservations, "ready", 1, -1, 0
        )
        return True

    def unload(self, runner_ids: list[str], snap: Snapshot) -> None:
        for rid in runner_ids:
            if rid in self.runners and self.runners[rid].in_flight == 0:
                del self.runners[rid]

    def apply(self, kind: str, arg: int) -> None:
        """A job ends, an idle runner expires, a worker dies (the reaper drops its device,
        runners and reservations) or joins."""
        if kind in ("finish", "expire") and self.runners:
            rid = sorted(self.runners)[arg % len(self.runners)]
            r = self.runners[rid]
            if kind == "finish":
                self.runners[rid] = replace(r, in_flight=max(0, r.in_flight - 1))
            elif r.in_flight == 0:
                del self.runners[rid]
        elif kind == "die":
            self.alive.discard(f"d{arg}")
            self.runners = {k: r for k, r in self.runners.items() if f"d{arg}" not in r.devices}
        elif kind == "join":
            self.alive.add(f"d{arg}")

    def new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def place(self, job: JobNeeds, snap: Snapshot, max_queue: int = 8) -> str:
        """Decide on ``snap`` (perhaps stale) and commit as the placement service does."""
        decision = decide(job, snap, "binpack", 0.0, max_queue, 3)

        def fields(_load: Load) -> dict[str, Any]:
            return {"model": job.model, "config_key": job.config_key}

        match commit(decision, fields, self, snap, 0.0, self.new_id(), new_id=self.new_id):
            case Assigned():
                return "served"
            case Wait():
                return "parked"
            case Refuse(code, _):
                return "refused:" + code
        return "lost race"


events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(sorted(MODELS)), st.integers(0, 2)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("expire"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("die"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("join"), st.integers(0, 2), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(events, st.integers(1, 3))
def test_simulated_cluster_keeps_invariants(trace: list, placers: int) -> None:
    cluster = Cluster(total={"d0": 4 * GIB, "d1": 6 * GIB, "d2": 8 * GIB}, alive={"d0", "d1", "d2"})
    parked: list[JobNeeds] = []
    outcomes: list[str] = []
    stale = [cluster.snapshot(0) for _ in range(placers)]  # each placer's last view
    for step, (kind, arg, placer) in enumerate(trace):
        if kind == "arrive":
            job = needs(arg)
            view = stale[placer % placers]
            outcome = cluster.place(job, view)
            if outcome == "lost race":  # re-decide on a fresh snapshot, as the service does
                outcome = cluster.place(job, cluster.snapshot(len(parked)))
            if outcome in ("parked", "lost race"):
                parked.append(job)
            else:
                outcomes.append(outcome)
        else:
            cluster.apply(kind, arg)
        stale[step % placers] = cluster.snapshot(len(parked))
        # wake parked jobs on every event, in order
        still = []
        for job in parked:
            outcome = cluster.place(job, cluster.snapshot(len(still)), max_queue=10**6)
            (still.append(job) if outcome in ("parked", "lost race") else outcomes.append(outcome))
        parked = still
        for dev, total in cluster.total.items():
            assert cluster.reserved(dev) <= total, "over-committed"
        for r in cluster.runners.values():
            assert set(r.devices) <= cluster.alive, "runner leaked on a dead device"
    # Drain: finish everything; every job ends served or refused with a reason.
    cluster.alive = set(cluster.total)
    for _ in range(len(parked) + 1):
        cluster.runners = {k: replace(r, in_flight=0) for k, r in cluster.runners.items()}
        still = []
        for job in parked:
            outcome = cluster.place(job, cluster.snapshot(0), max_queue=10**6)
            (still.append(job) if outcome in ("parked", "lost race") else outcomes.append(outcome))
        parked = still
    assert not parked
    assert all(o == "served" or o.startswith("refused:") for o in outcomes)


@given(
    st.lists(
        st.tuples(st.sampled_from(["gpu", "vgpu", "cpu"]), st.integers(0, 8), st.booleans()),
        max_size=12,
    ),
    st.integers(0, 8),
    st.sampled_from(["binpack", "spread"]),
)
def test_first_fit_finds_what_pick_picks_among_all(
    specs: list[tuple[str, int, bool]], need: int, policy: str
) -> None:
    """The bisection over devices sorted by free memory picks the device the walk over
    every device picks (ties of free memory included: ids decide)."""
    devices = [
        DeviceState(f"d{i % 5}{i}", "w", "q", kind, 8, free, 0)  # type: ignore[arg-type]
        for i, (kind, free, _ok) in enumerate(specs)
    ]
    ok = {d.id for d, (_k, _f, good) in zip(devices, specs, strict=True) if good}
    snap = Snapshot(devices, [])
    fits = [d for d in devices if d.free >= need and d.id in ok]
    found = first_fit(snap.by_free, need, policy, lambda d: d.id in ok)  # type: ignore[arg-type]
    assert found == (pick(fits, need, policy) if fits else None)  # type: ignore[arg-type]

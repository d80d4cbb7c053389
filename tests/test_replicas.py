"""Replicas of a model in the pure decision: branch 3's sub-branches (numbers as in
decide's docstring), the eviction order that puts idle replicas first, and properties over
random snapshots and over decisions applied one after another."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster import RunnerState, Snapshot, eviction_order
from scheduler.placement.decision import decide
from scheduler.placement.needs import JobNeeds
from scheduler.placement.verdict import Decision, Evict, Load, Park, Refuse, Route
from tests.test_decision import GIB, dev, runner


def hot(**fields: object) -> JobNeeds:
    return replace(JobNeeds("m", "c1", 2 * GIB), **fields)  # type: ignore[arg-type]


def slots(r: RunnerState, n: int = 4) -> RunnerState:
    return replace(r, num_parallel=n)


def place(
    needs: JobNeeds,
    devices: list,
    runners: list[RunnerState],
    demand: dict[str, float] | None = None,
    parked: int = 0,
    parked_models: frozenset[str] = frozenset(),
    max_queue: int = 10,
) -> Decision:
    snap = Snapshot(devices, runners, parked, demand or {}, parked_models)
    return decide(needs, snap, "binpack", now=50.0, max_queue=max_queue, max_loaded=3)


FOUR = [dev("a", 8, reserved=2), dev("b", 8), dev("c", 8), dev("d", 8)]


def test_3_one_replica_by_default_queues_at_the_saturated_runner() -> None:
    busy = [slots(runner("r1", "m", "a", 2, in_flight=4))]
    assert place(hot(), FOUR, busy) == Route("r1", "a")


def test_3a_a_floor_loads_replicas_while_the_first_has_free_slots() -> None:
    idle = [slots(runner("r1", "m", "a", 2))]
    out = place(hot(min_replicas=2), [dev("a", 8, reserved=2), dev("b", 4)], idle)
    assert out == Load("b", 2 * GIB)
    # a device holding another configuration of the model comes after an empty one
    other = [*idle, runner("o", "m", "b", 2, config="c2", in_flight=1)]
    devices = [dev("a", 8, reserved=2), dev("b", 4, reserved=2), dev("c", 8)]
    assert place(hot(min_replicas=2), devices, other) == Load("c", 2 * GIB)
    met = [*idle, slots(runner("r2", "m", "b", 2))]
    assert place(hot(min_replicas=2), FOUR, met) == Route("r1", "a")


def test_3a_a_floor_evicts_idle_runners_of_other_models_but_never_busy_ones() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 4, reserved=3)]
    first = slots(runner("r1", "m", "a", 2))
    cold = runner("x", "other", "b", 3)
    assert place(hot(min_replicas=2), devices, [first, cold]) == Evict(["x"])
    busy = replace(cold, in_flight=1)
    assert place(hot(min_replicas=2), devices, [first, busy]) == Route("r1", "a")


def test_3b_the_affine_runner_takes_the_job_while_it_has_a_free_slot() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2)]
    r1 = slots(runner("r1", "m", "a", 2, in_flight=3))
    r2 = slots(runner("r2", "m", "b", 2, in_flight=0))
    assert place(hot(affine="r1"), devices, [r1, r2]) == Route("r1", "a")
    assert place(hot(affine="gone"), devices, [r1, r2]) == Route("r2", "b")
    full = replace(r1, in_flight=4)  # saturated: the replica with a free slot wins
    assert place(hot(affine="r1"), devices, [full, r2]) == Route("r2", "b")


def test_3c_the_least_busy_replica_with_a_free_slot_and_a_loading_one_counts() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2), dev("c", 8, reserved=2)]
    runners = [
        slots(runner("r1", "m", "a", 2, in_flight=4)),
        slots(runner("r2", "m", "b", 2, in_flight=2, state="loading")),
        slots(runner("r3", "m", "c", 2, in_flight=2, last_used=9.0)),
    ]
    assert place(hot(max_replicas=4), devices, runners) == Route("r2", "b")


def test_3c_never_a_saturated_runner_while_a_bigger_replica_has_room() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2)]
    one_slot = runner("r1", "m", "a", 2, in_flight=1)
    four = slots(runner("r2", "m", "b", 2, in_flight=2))
    assert place(hot(), devices, [one_slot, four]) == Route("r2", "b")


def test_3d_all_saturated_loads_a_replica_on_a_device_without_the_model() -> None:
    devices = [dev("a", 8, reserved=4), dev("b", 3, reserved=1), dev("c", 8), dev("d", 4)]
    runners = [
        slots(runner("r1", "m", "a", 2, in_flight=4)),
        runner("o", "m", "b", 1, config="c2", in_flight=1),  # model m, another config
        runner("x", "z", "a", 2, in_flight=1),
    ]
    # d and c hold no runner of m: binpack picks the tightest of them, never a's second slot
    assert place(hot(max_replicas=2), devices, runners) == Load("d", 2 * GIB)
    # at max_replicas: queue at the least busy
    two = [*runners, slots(runner("r2", "m", "c", 2, in_flight=5))]
    assert place(hot(max_replicas=2), devices, two) == Route("r1", "a")


def test_3d_a_replica_never_goes_to_the_cpu_while_one_runs_on_a_gpu() -> None:
    devices = [dev("g", 8, reserved=2, kind="gpu"), dev("cpu", 64, kind="cpu")]
    busy = [slots(runner("r1", "m", "g", 2, in_flight=4))]
    assert place(hot(max_replicas=2), devices, busy) == Route("r1", "g")
    on_cpu = [slots(runner("r1", "m", "cpu", 2, in_flight=4))]
    devices = [dev("cpu", 64, reserved=2, kind="cpu"), dev("cpu2", 64, kind="cpu")]
    assert place(hot(max_replicas=2), devices, on_cpu) == Load("cpu2", 2 * GIB)


def test_3d_evicts_idle_runners_of_models_less_in_demand_only() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 4, reserved=3)]
    first = slots(runner("r1", "m", "a", 2, in_flight=4))
    idle = runner("x", "other", "b", 3)
    out = place(hot(max_replicas=2), devices, [first, idle], demand={"m": 5.0, "other": 1.0})
    assert out == Evict(["x"])
    kept = place(hot(max_replicas=2), devices, [first, idle], demand={"m": 1.0, "other": 5.0})
    assert kept == Route("r1", "a")  # the idle runner is worth more than a replica
    # ... unless it is itself an idle replica of its model: then it is the first victim
    twin = runner("x2", "other", "a", 1, in_flight=1)
    spare = place(hot(max_replicas=2), devices, [first, idle, twin], demand={"other": 5.0})
    assert spare == Evict(["x"])


def test_3d_never_evicts_busy_runners_nor_its_own_model() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 4, reserved=3)]
    first = slots(runner("r1", "m", "a", 2, in_flight=4))
    same_model = runner("y", "m", "b", 3, config="c2")  # idle, another config of m
    out = place(hot(max_replicas=2), devices, [first, same_model], demand={"m": 5.0})
    assert out == Route("r1", "a")
    busy = runner("x", "other", "b", 3, in_flight=1)
    assert place(hot(max_replicas=2), devices, [first, busy], demand={"m": 5.0}) == Route("r1", "a")


def test_3d_no_second_eviction_while_one_already_makes_room() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 4, reserved=3), dev("c", 4, reserved=3)]
    first = slots(runner("r1", "m", "a", 2, in_flight=4))
    going = runner("x", "other", "b", 3, state="unloading")
    idle = runner("y", "other", "c", 3)
    demand = {"m": 5.0}
    assert place(hot(max_replicas=3), devices, [first, going, idle], demand) == Route("r1", "a")
    assert place(hot(max_replicas=3), devices, [first, idle], demand) == Evict(["y"])


def test_3e_a_queue_depth_parks_when_every_replica_is_full() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2)]
    full = [
        slots(runner("r1", "m", "a", 2, in_flight=5)),
        slots(runner("r2", "m", "b", 2, in_flight=6)),
    ]
    assert place(hot(queue_depth=2, max_replicas=2), devices, full) == Route("r1", "a")
    out = place(hot(queue_depth=1, max_replicas=2), devices, full)
    assert isinstance(out, Park) and "'m'" in out.reason and "full" in out.reason
    busy = place(hot(queue_depth=1, max_replicas=2), devices, full, parked=10)
    assert isinstance(busy, Refuse) and busy.code == "server_busy"
    retried = hot(queue_depth=1, max_replicas=2, retry=True)
    snap = Snapshot(devices, full, 10)
    assert isinstance(decide(retried, snap, "binpack", 0.0, 10 + 11, 3), Park)
    # unbounded (the default): always queue at the least busy
    assert place(hot(max_replicas=2), devices, full) == Route("r1", "a")


def test_3e_parked_jobs_of_the_model_do_not_hold_back_a_runner_with_room() -> None:
    # they may wait for memory for another configuration of the model: a job for the
    # loaded one is routed past them, as branch 4 promises for models already loaded
    devices = [dev("a", 8, reserved=2)]
    parked = frozenset({"m"})
    roomy = [slots(runner("r1", "m", "a", 2, in_flight=5))]  # 4 slots, 1 of 2 waiting
    assert place(hot(queue_depth=2), devices, roomy, parked=3, parked_models=parked) == Route(
        "r1", "a"
    )
    full = [slots(runner("r1", "m", "a", 2, in_flight=6))]
    out = place(hot(queue_depth=2), devices, full, parked=3, parked_models=parked)
    assert isinstance(out, Park) and "full" in out.reason


def test_3e_the_affine_runner_within_the_slack_of_the_least_busy() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2)]
    r1 = slots(runner("r1", "m", "a", 2, in_flight=5))  # 1 waiting
    r2 = slots(runner("r2", "m", "b", 2, in_flight=4))  # 0 waiting
    assert place(hot(affine="r1"), devices, [r1, r2]) == Route("r1", "a")
    far = replace(r1, in_flight=6)  # 2 waiting: more than ⌈0.25 × 4⌉ = 1 beyond
    assert place(hot(affine="r1"), devices, [far, r2]) == Route("r2", "b")
    assert place(hot(affine="r1", queue_depth=1), devices, [r1, r2]) == Route("r2", "b")


def test_3_never_routes_to_an_unloading_replica() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8, reserved=2)]
    runners = [
        slots(runner("r1", "m", "a", 2, state="unloading")),
        slots(runner("r2", "m", "b", 2, in_flight=4)),
    ]
    assert place(hot(affine="r1", max_replicas=2), devices, runners) == Load("a", 2 * GIB)


def test_an_idle_replica_is_the_first_victim() -> None:
    pinned = runner("pin", "y", "a", 1, expires_at=-1)
    cold = runner("cold", "x", "a", 1, expires_at=60)
    spare = runner("spare", "hot", "a", 1, expires_at=900)
    twin = runner("twin", "hot", "b", 1, in_flight=2)
    snap = Snapshot([dev("a", 8), dev("b", 8)], [pinned, cold, spare, twin], demand={"hot": 9})
    order = sorted([pinned, cold, spare], key=eviction_order(snap.demand, snap.live_by_model))
    assert [r.id for r in order] == ["spare", "cold", "pin"]
    assert [r.id for r in snap.idle_by_device["a"]] == ["spare", "cold", "pin"]
    without = sorted([pinned, cold, spare], key=eviction_order(snap.demand))
    assert [r.id for r in without] == ["cold", "spare", "pin"]
    job = JobNeeds("new", "c1", 6 * GIB)  # needs one of the three gone (max_loaded 3)
    devices = [dev("a", 8, reserved=3), dev("b", 8, reserved=8)]
    out = place(job, devices, [pinned, cold, spare, twin], demand={"hot": 9})
    assert out == Evict(["spare"])
    # a pinned replica (a floor of `ggufq load --replicas`, keep_alive -1) stays last
    floor = replace(spare, expires_at=-1)
    order = sorted([pinned, cold, floor], key=eviction_order(snap.demand, snap.live_by_model))
    assert [r.id for r in order] == ["cold", "spare", "pin"]


def test_an_idle_replica_of_a_model_in_demand_costs_its_share() -> None:
    # a new model needs one runner gone: an idle replica of "hot" on "a" (another of its
    # two runners busy on "c"), or the only runner of "cold" on "b". The replica brings back
    # half its part of hot's demand (0.5 × 8 / 2 = 2), more than cold's 1: cold goes.
    spare = runner("spare", "hot", "a", 6, expires_at=900)
    twin = runner("twin", "hot", "c", 6, in_flight=1)
    alone = runner("alone", "cold", "b", 6, expires_at=900)
    devices = [dev("a", 8, reserved=6), dev("b", 8, reserved=6), dev("c", 8, reserved=6)]
    job = JobNeeds("new", "c1", 6 * GIB)
    runners = [spare, twin, alone]
    assert place(job, devices, runners, demand={"hot": 8.0, "cold": 1.0}) == Evict(["alone"])
    # with hot's demand lower, its idle replica is the cheaper one to unload again
    assert place(job, devices, runners, demand={"hot": 3.0, "cold": 1.0}) == Evict(["spare"])


# -- properties ----------------------------------------------------------------------------


@st.composite
def replica_snapshots(draw: st.DrawFn) -> tuple[Snapshot, JobNeeds]:
    n = draw(st.integers(1, 5))
    devices = [dev(f"d{i}", draw(st.sampled_from([4, 8, 16]))) for i in range(n)]
    runners = []
    for i, d in enumerate(devices):
        for k in range(draw(st.integers(0, 2))):
            model = draw(st.sampled_from(["m", "m", "x"]))
            par = draw(st.sampled_from([1, 2, 4]))
            runners.append(
                RunnerState(
                    id=f"r{i}{k}",
                    model=model,
                    config_key=draw(st.sampled_from(["c1", "c1", "c2"])),
                    devices={d.id: GIB},
                    state=draw(st.sampled_from(["loading", "ready", "ready", "unloading"])),
                    in_flight=draw(st.integers(0, 2 * par + 1)),
                    expires_at=draw(st.sampled_from([-1.0, 60.0, 90.0])),
                    last_used=draw(st.floats(0, 100)),
                    num_parallel=par,
                )
            )
    reserved = {d.id: sum(r.devices.get(d.id, 0) for r in runners) for d in devices}
    devices = [replace(d, reserved=reserved[d.id]) for d in devices]
    same = [r.id for r in runners if r.model == "m" and r.config_key == "c1"]
    job = hot(
        max_replicas=draw(st.integers(1, 4)),
        min_replicas=draw(st.integers(0, 3)),
        affine=draw(st.sampled_from([None, "nope", *same])),
        queue_depth=draw(st.integers(-1, 2)),
        retry=draw(st.booleans()),
    )
    demand = {"m": draw(st.floats(0, 5)), "x": draw(st.floats(0, 5))}
    return Snapshot(devices, runners, draw(st.integers(0, 12)), demand), job


@settings(max_examples=500, deadline=None)
@given(replica_snapshots())
def test_never_a_saturated_runner_while_a_same_config_replica_has_a_free_slot(
    case: tuple[Snapshot, JobNeeds],
) -> None:
    snap, job = case
    out = decide(job, snap, "binpack", now=50.0, max_queue=8, max_loaded=3)
    alive = {d.id for d in snap.devices}
    same = [
        r
        for r in snap.runners
        if (r.model, r.config_key) == ("m", "c1") and r.state != "unloading"
        if set(r.devices) <= alive
    ]
    if isinstance(out, Route):
        target = next(r for r in same if r.id == out.runner_id)
        if target.in_flight >= target.num_parallel:
            assert all(r.in_flight >= r.num_parallel for r in same)
            if job.queue_depth >= 0:
                assert target.in_flight < target.num_parallel + job.queue_depth
    if isinstance(out, Load):
        assert len(same) < max(job.max_replicas, job.min_replicas) or not same
        assert not any(out.device_id in r.devices for r in same)
        assert snap.devices[[d.id for d in snap.devices].index(out.device_id)].free >= out.bytes
    if isinstance(out, Evict):
        runners = {r.id: r for r in snap.runners}
        assert all(runners[i].in_flight == 0 for i in out.runner_ids)
        assert all(runners[i].model != "m" for i in out.runner_ids) or not same


arrivals = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "finish", "expire", "unloaded"]),
        st.integers(0, 30),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(arrivals, st.integers(1, 4), st.integers(0, 3), st.integers(-1, 2))
def test_applied_decisions_never_exceed_max_replicas(
    trace: list[tuple[str, int]], max_replicas: int, min_replicas: int, depth: int
) -> None:
    """Decisions carried out one after another (loads become runners with the job, routes
    add a job, evictions start unloading) never make more live runners of one model and
    configuration than max(max_replicas, min_replicas)."""
    cap = max(max_replicas, min_replicas)
    totals = {"d0": 8 * GIB, "d1": 8 * GIB, "d2": 6 * GIB, "d3": 4 * GIB}
    runners: dict[str, RunnerState] = {}
    counter = 0
    for kind, arg in trace:
        ids = sorted(runners)
        if kind == "arrive":
            model = "m" if arg % 3 else "x"
            job = JobNeeds(model, "c1", (2 + arg % 3) * GIB, max_replicas=max_replicas)
            job = replace(job, min_replicas=min_replicas, queue_depth=depth)
            job = replace(job, affine=ids[arg % len(ids)] if ids else None)
            devices = [
                dev(d, t / GIB, reserved=sum(r.devices.get(d, 0) for r in runners.values()) / GIB)
                for d, t in totals.items()
            ]
            snap = Snapshot(devices, list(runners.values()), demand={"m": 3.0, "x": 1.0})
            match decide(job, snap, "binpack", 0.0, 100, 3):
                case Route(rid, _):
                    r = runners[rid]
                    assert r.state != "unloading"
                    runners[rid] = replace(r, in_flight=r.in_flight + 1)
                case Load(device_id, nbytes):
                    counter += 1
                    runners[f"n{counter}"] = RunnerState(
                        f"n{counter}", model, "c1", {device_id: nbytes}, "loading", 1, -1, 0.0, 2
                    )
                case Evict(victims):
                    for rid in victims:
                        assert runners[rid].in_flight == 0
                        runners[rid] = replace(runners[rid], state="unloading")
        elif ids:
            rid = ids[arg % len(ids)]
            r = runners[rid]
            if kind == "finish" and r.in_flight:
                runners[rid] = replace(r, in_flight=r.in_flight - 1, state="ready")
            elif kind == "expire" and r.in_flight == 0:
                runners[rid] = replace(r, state="unloading")
            elif kind == "unloaded" and r.state == "unloading":
                del runners[rid]
        for model in ("m", "x"):
            live = [r for r in runners.values() if r.model == model and r.state != "unloading"]
            assert len(live) <= cap, (model, live)

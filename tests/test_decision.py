"""The pure placement decision, branch by branch (numbers as in decide's docstring)."""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from typing import Any

from api_client.cli.tables import processor
from scheduler.cluster import DeviceState, RunnerState, RunnerView, Snapshot
from scheduler.placement import decision as decision_module
from scheduler.placement.decision import decide
from scheduler.placement.fitting import split_blocks
from scheduler.placement.needs import GroupNeeds, JobNeeds, Where
from scheduler.placement.verdict import Evict, Load, Park, Refuse, Route

GIB = 1 << 30


def dev(
    id: str, total: float, free: float | None = None, reserved: float = 0, kind: str = "vgpu"
) -> DeviceState:
    return DeviceState(
        id=id,
        worker="w@h",
        queue="q." + id,
        kind=kind,  # type: ignore[arg-type]
        total=int(total * GIB),
        reported_free=int((free or total) * GIB),
        reserved=int(reserved * GIB),
    )


def runner(
    id: str,
    model: str,
    device: str,
    gib: float,
    in_flight: int = 0,
    expires_at: float = 100.0,
    config: str = "c1",
    state: str = "ready",
    last_used: float = 0.0,
) -> RunnerState:
    return RunnerState(
        id=id,
        model=model,
        config_key=config,
        devices={device: int(gib * GIB)},
        state=state,
        in_flight=in_flight,
        expires_at=expires_at,  # type: ignore[arg-type]
        last_used=last_used,
    )


def job(model: str = "m", gib: float = 2, config: str = "c1") -> JobNeeds:
    return JobNeeds(model=model, config_key=config, bytes=int(gib * GIB))


def run(
    needs: JobNeeds,
    devices: list[DeviceState],
    runners: list[RunnerState] | None = None,
    parked: int = 0,
    policy: str = "binpack",
    max_loaded: int = 3,
):
    return decide(
        needs,
        Snapshot(devices, runners or [], parked),
        policy,  # type: ignore[arg-type]
        now=50.0,
        max_queue=4,
        max_loaded=max_loaded,
    )


def test_1_no_devices_refuses_with_hint() -> None:
    out = run(job(), [])
    assert isinstance(out, Refuse) and out.code == "no_workers" and "ggufq up" in out.reason


def test_3_routes_to_least_busy_compatible_replica() -> None:
    devices = [dev("a", 8, reserved=4), dev("b", 8, reserved=4)]
    runners = [runner("r1", "m", "a", 2, in_flight=3), runner("r2", "m", "b", 2, in_flight=1)]
    assert run(job(), devices, runners) == Route("r2", "b")


def test_3_never_routes_to_a_runner_on_a_dead_device() -> None:
    # the snapshot lists only alive devices; a runner of a device not yet reaped is no target
    runners = [runner("r1", "m", "dead", 2, in_flight=0)]
    assert run(job(), [dev("a", 8)], runners) == Load("a", 2 * GIB)


def test_3_never_routes_to_unloading_runner() -> None:
    devices = [dev("a", 8, reserved=2)]
    runners = [runner("r1", "m", "a", 2, state="unloading")]
    assert isinstance(run(job(), devices, runners), Load)


def test_5_idle_runner_with_other_config_is_evicted_for_reload() -> None:
    devices = [dev("a", 8, reserved=2)]
    runners = [runner("r1", "m", "a", 2, config="old")]
    assert run(job(config="new"), devices, runners) == Evict(["r1"])


def test_5_busy_runner_with_other_config_gets_a_neighbour() -> None:
    devices = [dev("a", 8, reserved=2)]
    runners = [runner("r1", "m", "a", 2, config="old", in_flight=1)]
    assert run(job(config="new"), devices, runners) == Load("a", 2 * GIB)


def test_7_binpack_picks_tightest_fit_and_spread_the_roomiest() -> None:
    devices = [dev("big", 24), dev("small", 4), dev("mid", 8)]
    assert run(job(gib=3), devices) == Load("small", 3 * GIB)
    assert run(job(gib=3), devices, policy="spread") == Load("big", 3 * GIB)


def test_7_main_gpu_loads_a_new_runner_on_that_gpu_when_it_fits() -> None:
    """Ollama's ``main_gpu``: the GPU of that index on its host, before the policy's
    choice; where it has no room, the policy's choice."""
    devices = [dev("vgpu:h:0", 24), dev("vgpu:h:1", 4), dev("vgpu:h:2", 8)]
    assert run(job(gib=3), devices) == Load("vgpu:h:1", 3 * GIB)  # binpack: the tightest
    assert run(replace(job(gib=3), main_gpu=2), devices) == Load("vgpu:h:2", 3 * GIB)
    assert run(replace(job(gib=6), main_gpu=1), devices) == Load("vgpu:h:2", 6 * GIB)


def test_7_gpus_before_cpu() -> None:
    devices = [dev("cpu", 64, kind="cpu"), dev("g", 8, kind="gpu")]
    assert run(job(gib=3), devices) == Load("g", 3 * GIB)


def test_7_free_is_min_of_reported_and_unreserved() -> None:
    devices = [dev("a", 8, free=1)]  # the driver says 1 GiB free whatever we reserved
    assert isinstance(run(job(gib=2), devices), Park)


def test_10_evicts_fewest_idle_runners_expiring_soonest() -> None:
    devices = [dev("a", 8, reserved=7)]
    runners = [runner("old", "x", "a", 3, expires_at=60), runner("new", "y", "a", 4, expires_at=90)]
    assert run(job(gib=3), devices, runners) == Evict(["old"])


def test_11_never_evicts_busy_runners_and_parks() -> None:
    devices = [dev("a", 8, reserved=7)]
    runners = [runner("busy", "x", "a", 7, in_flight=1)]
    out = run(job(gib=3), devices, runners)
    assert isinstance(out, Park) and "busy" in out.reason


def test_7_max_loaded_forces_an_eviction() -> None:
    devices = [dev("a", 80, reserved=3)]
    runners = [runner(f"r{i}", f"x{i}", "a", 1, expires_at=60 + i) for i in range(3)]
    assert run(job(gib=1), devices, runners, max_loaded=3) == Evict(["r0"])


def test_9_too_many_parked_refuses_at_once() -> None:
    devices = [dev("a", 8, reserved=7)]
    runners = [runner("busy", "x", "a", 7, in_flight=1)]
    out = run(job(gib=3), devices, runners, parked=4)
    assert isinstance(out, Refuse) and out.code == "server_busy" and "max_queue 4" in out.reason


def test_6d_larger_than_any_device_refuses_with_sizes() -> None:
    out = run(job(gib=30), [dev("a", 8), dev("b", 16)])
    assert isinstance(out, Refuse) and out.code == "no_capacity"
    assert "30.0 GiB" in out.reason and "16.0 GiB" in out.reason
    assert set(out.per_device) == {"a", "b"}


def test_10_evicts_the_least_demanded_model_first() -> None:
    devices = [dev("a", 8, reserved=7)]
    runners = [
        runner("hot", "x", "a", 3, expires_at=60),
        runner("cold", "y", "a", 4, expires_at=90),
    ]
    snap = Snapshot(devices, runners, 0, demand={"x": 9.0, "y": 0.5})
    out = decide(job(gib=3), snap, "binpack", now=50.0, max_queue=4, max_loaded=3)
    assert out == Evict(["cold"])  # though "hot" expires sooner


def test_10_evicts_the_set_that_brings_back_the_fewest_loads() -> None:
    # one hot runner on "a" would make room, two cold ones on "b" would: the two go, as
    # the hot model would be loaded again soon (the fewest runners is only the tie-break)
    devices = [dev("a", 8, reserved=7), dev("b", 8, reserved=7)]
    runners = [
        runner("hot", "x", "a", 7, expires_at=60),
        runner("cold1", "y", "b", 3, expires_at=60),
        runner("cold2", "z", "b", 4, expires_at=60),
    ]
    snap = Snapshot(devices, runners, 0, demand={"x": 9.0, "y": 0.5, "z": 0.5})
    out = decide(job(gib=6), snap, "binpack", now=50.0, max_queue=4, max_loaded=3)
    assert out == Evict(["cold1", "cold2"])
    # with the demand even, the fewest runners
    even = Snapshot(devices, runners, 0, demand={"x": 1.0, "y": 0.5, "z": 0.5})
    assert decide(job(gib=6), even, "binpack", 50.0, 4, 3) == Evict(["hot"])
    # each runner unloaded is a load in time: two whose demand adds up to a little less
    # than the one's cost more (the mean demand of the loaded models is 1.2, a reload
    # weighs twice that: 2 + 2.4 = 4.4 for "hot", 1.6 + 2 × 2.4 = 6.4 for the two)
    close = Snapshot(devices, runners, 0, demand={"x": 2.0, "y": 0.8, "z": 0.8})
    assert decide(job(gib=6), close, "binpack", 50.0, 4, 3) == Evict(["hot"])


def test_decayed_demand() -> None:
    from scheduler.cluster import DEMAND_TAU_S, decayed

    assert decayed(10.0, 100.0, 100.0) == 10.0
    assert abs(decayed(10.0, 0.0, DEMAND_TAU_S) - 10.0 / 2.718281828) < 1e-6
    assert decayed(5.0, 100.0, 50.0) == 5.0  # a clock that went back does not inflate it


def test_6b_partial_offload_when_no_device_holds_it_whole() -> None:
    devices = [dev("g", 8, reserved=1)]
    needs = JobNeeds("big", "c1", 12 * GIB, partial=tuple(g * GIB for g in (2, 4, 6, 8, 10)))
    snap = Snapshot(devices, [runner("busy", "x", "g", 1, in_flight=1)])
    assert decide(needs, snap, "binpack", 0.0, 4, 3) == Load("g", 6 * GIB, n_gpu_layers=3)


def test_6b_park_when_a_layer_would_fit_on_an_emptier_gpu() -> None:
    devices = [dev("g", 8, reserved=7)]
    needs = JobNeeds("big", "c1", 12 * GIB, partial=(2 * GIB, 4 * GIB))
    snap = Snapshot(devices, [runner("busy", "x", "g", 7, in_flight=1)])
    assert isinstance(decide(needs, snap, "binpack", 0.0, 4, 3), Park)


def test_6d_refuse_when_not_even_one_layer_fits() -> None:
    needs = JobNeeds("big", "c1", 40 * GIB, partial=(20 * GIB, 30 * GIB))
    out = decide(needs, Snapshot([dev("g", 8)], []), "binpack", 0.0, 4, 3)
    assert isinstance(out, Refuse) and out.code == "no_capacity"


def test_ps_processor_column() -> None:
    whole = runner_view(n_gpu_layers=-1, bytes=100, size=100)
    assert processor(whole, {"gpu"}) == "100% GPU"
    assert processor(whole, {"cpu"}) == "100% CPU"
    split = runner_view(n_gpu_layers=3, bytes=65, size=100)
    assert processor(split, {"vgpu"}) == "35%/65% CPU/GPU"


def runner_view(**fields: Any) -> RunnerView:
    base: dict[str, Any] = dict(
        id="r",
        model="m",
        state="ready",
        devices={"g": 1},
        bytes=1,
        size=1,
        context_length=4096,
        num_parallel=1,
        n_gpu_layers=-1,
        block_count=8,
        embedding=False,
        in_flight=0,
        keep_alive_s=300,
        expires_at=-1,
        last_used=0,
    )
    return RunnerView(**(base | fields))


def group_job(blocks: int = 8, block_gib: float = 1, per_device: float = 0.5) -> JobNeeds:
    group = GroupNeeds(
        per_block=(int(block_gib * GIB),) * blocks, per_device=int(per_device * GIB), last=GIB
    )
    total = int((blocks * block_gib + per_device + 1) * GIB)
    return JobNeeds(model="big", config_key="c1", bytes=total, group=group)


def test_6a_spans_the_fewest_gpus_of_one_worker() -> None:
    # 9.5 GiB: no 6 GiB GPU holds it; two of them do (blocks split 5 + 3, output on the last)
    devices = [dev("a", 6), dev("b", 6), dev("c", 6)]
    decision = decide(group_job(), Snapshot(devices, []), "binpack", 0.0, 10, 3)
    assert isinstance(decision, Load) and len(decision.split) == 2
    assert [blocks for _, _, blocks in decision.split] == [5, 3]
    assert sum(decision.reservations.values()) == decision.bytes == int(10 * GIB)
    assert all(nbytes <= 6 * GIB for nbytes in decision.reservations.values())


def test_6a_groups_never_cross_workers() -> None:
    devices = [dev("a", 6), replace(dev("b", 6), worker="other@h2")]
    decision = decide(group_job(), Snapshot(devices, []), "binpack", 0.0, 10, 3)
    assert not isinstance(decision, Load)


def test_6c_parks_when_the_group_is_busy_and_could_fit_empty() -> None:
    devices = [dev("a", 6, reserved=3), dev("b", 6)]
    busy = [runner("r1", "other", "a", 3, in_flight=1)]
    decision = decide(group_job(), Snapshot(devices, busy), "binpack", 0.0, 10, 3)
    assert isinstance(decision, Park)


def test_8_split_leaves_a_block_for_every_device() -> None:
    group = GroupNeeds(per_block=(GIB,) * 4, per_device=0, last=3 * GIB)
    split = split_blocks(group, [dev("a", 8), dev("b", 4)])
    assert split is not None and [b for _, _, b in split] == [3, 1]


def test_3_a_job_that_asks_for_slots_needs_a_runner_with_that_many() -> None:
    devices = [dev("a", 8)]
    four = replace(runner("r4", "m", "a", 2), num_parallel=4)
    snap = Snapshot(devices, [four])
    assert decide(job(), snap, "binpack", 0.0, 10, 3) == Route("r4", "a")
    asks_four = replace(job(), num_parallel=4)
    assert decide(asks_four, snap, "binpack", 0.0, 10, 3) == Route("r4", "a")
    asks_eight = replace(job(), num_parallel=8)
    assert decide(asks_eight, snap, "binpack", 0.0, 10, 3) == Evict(["r4"])  # idle: reload


def test_3_a_job_that_asks_for_gpu_layers_needs_a_runner_with_that_many() -> None:
    devices = [dev("a", 8)]
    partial = replace(runner("r2", "m", "a", 1), n_gpu_layers=2)
    snap = Snapshot(devices, [partial])
    assert decide(job(), snap, "binpack", 0.0, 10, 3) == Route("r2", "a")  # -1: any runner
    two = replace(job(gib=1), n_gpu_layers=2)
    assert decide(two, snap, "binpack", 0.0, 10, 3) == Route("r2", "a")
    whole = replace(job(), n_gpu_layers=0)  # the whole model on a GPU: not a partial runner
    assert decide(whole, snap, "binpack", 0.0, 10, 3) == Evict(["r2"])
    three = replace(job(gib=1.5), n_gpu_layers=3)
    fresh = decide(three, Snapshot(devices, []), "binpack", 0.0, 10, 3)
    assert fresh == Load("a", int(1.5 * GIB), 3)


def test_2_a_pinned_job_uses_its_device_or_is_refused_naming_the_alive_ones() -> None:
    devices = [dev("a", 8), dev("b", 8)]
    pinned = replace(job(), where=Where(device="b"))
    assert run(pinned, devices) == Load("b", 2 * GIB)
    gone = run(replace(job(), where=Where(device="z")), devices)
    assert isinstance(gone, Refuse) and gone.code == "invalid_request"
    assert "'z' is not alive" in gone.reason and "a, b" in gone.reason


def test_2_a_failed_load_avoids_its_device_and_fails_when_none_is_left() -> None:
    devices = [dev("a", 8), dev("b", 8)]
    assert run(replace(job(), where=Where(avoid=("a",))), devices) == Load("b", 2 * GIB)
    out = run(replace(job(), where=Where(avoid=("a", "b"))), devices)
    assert isinstance(out, Refuse) and out.code == "load_failed" and "a, b" in out.reason


def test_2_num_gpu_zero_means_the_cpu_and_a_layer_count_means_gpus() -> None:
    devices = [dev("g", 8, kind="gpu"), dev("cpu", 64, kind="cpu")]
    assert run(replace(job(), where=Where(num_gpu=0)), devices) == Load("cpu", 2 * GIB)
    no_cpu = run(replace(job(), where=Where(num_gpu=0)), [dev("g", 8, kind="gpu")])
    assert isinstance(no_cpu, Refuse) and "ggufq worker --cpu" in no_cpu.reason
    layers = replace(job(), where=Where(num_gpu=3, layers=3), n_gpu_layers=3)
    no_gpu = run(layers, [dev("cpu", 64, kind="cpu")])
    assert isinstance(no_gpu, Refuse) and "num_gpu 3 asks for 3 layers" in no_gpu.reason


def test_2_runners_on_devices_the_job_may_not_use_are_not_routed_to() -> None:
    devices = [dev("a", 8, reserved=2), dev("b", 8)]
    runners = [runner("r1", "m", "a", 2, in_flight=1)]
    assert run(replace(job(), where=Where(device="b")), devices, runners) == Load("b", 2 * GIB)


def parked_snapshot(parked: int, models: frozenset[str]) -> Snapshot:
    return Snapshot([dev("a", 8)], [], parked, parked_models=models)


def test_4_a_new_runner_waits_behind_the_parked_jobs_of_its_model() -> None:
    snap = parked_snapshot(2, frozenset({"m"}))
    out = decide(job(), snap, "binpack", 0.0, 10, 3)
    assert isinstance(out, Park) and "earlier jobs for 'm'" in out.reason
    other = decide(job(model="x"), snap, "binpack", 0.0, 10, 3)
    assert other == Load("a", 2 * GIB)  # parked jobs of another model hold nothing back


def test_4_a_loaded_runner_takes_a_job_past_the_parked_ones() -> None:
    snap = Snapshot([dev("a", 8, reserved=2)], [runner("r", "m", "a", 2, in_flight=1)], 2)
    snap = replace(snap, parked_models=frozenset({"m"}))
    assert decide(job(), snap, "binpack", 0.0, 10, 3) == Route("r", "a")


def test_4_behind_a_full_queue_a_new_job_is_refused_and_a_retried_one_never() -> None:
    snap = parked_snapshot(4, frozenset({"m"}))
    out = decide(job(), snap, "binpack", 0.0, 4, 3)
    assert isinstance(out, Refuse) and out.code == "server_busy"
    retried = replace(job(), retry=True)
    assert decide(retried, snap, "binpack", 0.0, 4, 3) == Load("a", 2 * GIB)
    busy = Snapshot([dev("a", 8, reserved=7)], [runner("b", "x", "a", 7, in_flight=1)], 4)
    assert isinstance(decide(retried, busy, "binpack", 0.0, 4, 3), Park)  # 9 spares it too


def test_branch_markers_run_in_order() -> None:
    """The numbers in decide's docstring and the markers in the code tie them together."""
    source = inspect.getsource(decision_module)
    markers = re.findall(r"^\s+# (\d+)([a-z]?)$", source[source.index("def decide(") :], re.M)
    numbered = [int(n) for n, letter in markers if not letter]
    assert numbered == list(range(1, 12))
    lettered = [n + letter for n, letter in markers if letter]
    assert lettered == ["3a", "3b", "3c", "3d", "3e", "6a", "6b", "6c", "6d"]
    for sub in lettered:  # each lettered branch is documented under its number
        number, letter = sub[:-1], sub[-1]
        block = (decide.__doc__ or "").split(f"    {number}. ", 1)[1]
        assert re.search(rf"^ +{letter}\. ", block, re.M), sub
    documented = re.findall(r"^ {4}(\d+)\. ", decide.__doc__ or "", flags=re.M)
    assert documented == [str(n) for n in range(1, 12)]

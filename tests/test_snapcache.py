"""The change-log snapshot cache agrees with a full read of Redis, whatever happened."""

from __future__ import annotations

import random
from typing import Any

import pytest
import redis

from scheduler.cluster import Snapshot
from scheduler.placement import snapcache
from scheduler.placement.snapcache import SnapshotCache
from scheduler.protocol import Placement, RunnerConfig
from scheduler.store import keys, records
from tests.test_state import GIB, ClusterState, vgpu

CONFIG = RunnerConfig(512)


def view(snap: Snapshot) -> dict[str, object]:
    """Everything the decision reads, in comparable form (it reads alive devices only)."""
    alive = {d.id for d in snap.devices}
    return {
        "devices": sorted(snap.devices, key=lambda d: d.id),
        "live": {m: sorted(r.id for r in rs) for m, rs in snap.live_by_model.items() if rs},
        "all_live": {m: sorted(r.id for r in rs) for m, rs in snap.all_live_by_model.items()},
        "counts": {d: c for d, c in snap.counts.items() if c and d in alive},
        "idle": {d: [r.id for r in snap.idle_by_device.get(d, [])] for d in sorted(alive)},
        "parked": snap.parked,
        "by_free": [d.id for d in snap.by_free],
        "largest": snap.largest_total,
        "by_id": sorted(snap.device_by_id),
    }


def on_runner(
    state: ClusterState,
    action: str,
    runner_id: str,
    given: list[str],
    step: int,
    now: float,
    rng: random.Random,
) -> bool:
    """One step on a runner; False when it is to be released (it began unloading).
    ``given``: its placements not ended yet."""
    if action == "assign":
        if state.assign(runner_id, f"p{step}", now):
            given.append(f"p{step}")
    elif action == "finish":
        placement_id = given.pop(rng.randrange(len(given))) if given else f"p{step}"
        placement = Placement(
            id=placement_id, runner_id=runner_id, device_id="vgpu:h:0", config=CONFIG
        )
        state.end(placement, f"j{step}", (0, None), now, rng.choice([0, 60, -1]), 60)
    elif action == "ready":
        state.update_runner(runner_id, {"state": "ready"})
    elif state.begin_unload(runner_id, force=rng.random() < 0.3):
        return False
    return True


def test_cache_matches_full_read_through_random_changes(db: redis.Redis) -> None:
    rng = random.Random(7)
    state, cache = ClusterState(db), SnapshotCache(db)
    now = 1000.0
    devices = [vgpu(i, 8) for i in range(4)]
    for dev in devices:
        state.register_device(dev)
    runners: list[str] = []
    given: dict[str, list[str]] = {}  # runner -> the placements it was given
    for step in range(300):
        now += rng.random()
        action = rng.choice(["reserve", "assign", "finish", "ready", "unload", "beat", "reap"])
        if action == "reserve":
            runner_id = f"r{step}"
            dev = rng.choice(devices).id
            fields = {"model": f"m{rng.randrange(5)}", "config_key": "c"}
            size = rng.choice([1, 2, 3]) * GIB
            if state.reserve(runner_id, f"p{step}", {dev: size}, fields, now, 30):
                runners.append(runner_id)
                given[runner_id] = [f"p{step}"]
        elif action in ("assign", "finish", "ready", "unload") and runners:
            runner_id = rng.choice(runners)
            if not on_runner(state, action, runner_id, given[runner_id], step, now, rng):
                state.release(runner_id, [d.id for d in devices])
                runners.remove(runner_id)
        elif action == "beat":
            state.heartbeat({d.id: rng.randrange(4, 9) * GIB for d in devices[:3]})
        elif action == "reap" and rng.random() < 0.1:
            gone = devices.pop(rng.randrange(len(devices)))
            state.deregister_devices([gone.id])
            runners = [r for r in runners if db.exists(keys.runner(r))]
            devices.append(vgpu(10 + step, 8))
            state.register_device(devices[-1])
        if step % 7 == 0:
            assert view(cache.snapshot(now, 30)) == view(state.snapshot(now, 30)), step
    assert cache.reloads == 1  # only the first read loaded everything


def test_more_changes_than_one_look_reads_are_read_in_several(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet spell leaves more log entries than one look reads (a device's beat is one):
    they are read in several looks, not by reloading everything."""
    monkeypatch.setattr(snapcache, "MAX_CHANGES", 3)
    state, cache = ClusterState(db), SnapshotCache(db)
    for i in range(2):
        state.register_device(vgpu(i))
    cache.snapshot(1.0, 30)
    for n in range(4):  # 3 or more entries each
        fields = {"model": f"m{n}", "config_key": "c"}
        state.reserve(f"r{n}", f"p{n}", {vgpu(n % 2).id: GIB}, fields, 1.0, 30)
        state.heartbeat({vgpu(0).id: 6 * GIB, vgpu(1).id: 5 * GIB})
    assert view(cache.snapshot(2.0, 30)) == view(state.snapshot(2.0, 30))
    assert cache.reloads == 1  # the first look's alone


def test_cache_reloads_when_the_log_has_a_gap(db: redis.Redis) -> None:
    state, cache = ClusterState(db), SnapshotCache(db)
    state.register_device(vgpu(0))
    cache.snapshot(1.0, 30)
    state.reserve("r1", "p1", {vgpu(0).id: GIB}, {"model": "m", "config_key": "c"}, 1.0, 30)
    db.delete(keys.CHANGES)  # trimmed before this reader saw them: a gap in the numbers
    state.reserve("r2", "p2", {vgpu(0).id: GIB}, {"model": "m", "config_key": "c"}, 1.0, 30)
    snap = cache.snapshot(1.0, 30)
    assert cache.reloads == 2
    assert snap.devices[0].reserved == 2 * GIB
    db.flushdb()  # Redis restarted empty: the counter went back
    state.register_device(vgpu(1))
    assert [d.id for d in cache.snapshot(2.0, 30).devices] == [vgpu(1).id]
    assert cache.reloads == 3


def test_a_fetch_that_failed_is_read_again(db: redis.Redis, monkeypatch: Any) -> None:
    """The change log was read past the changes whose taking in failed: the next snapshot
    reloads, and a runner released meanwhile is gone from it."""
    state, cache = ClusterState(db), SnapshotCache(db)
    state.register_device(vgpu(0))
    state.reserve("r1", "p1", {vgpu(0).id: GIB}, {"model": "m", "config_key": "c"}, 1.0, 30)
    cache.snapshot(1.0, 30)
    state.release("r1", [vgpu(0).id])
    apply = cache._apply

    def broken(read: list[tuple[str, Any]]) -> set[str]:
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(cache, "_apply", broken)
    with pytest.raises(redis.ConnectionError):
        cache.snapshot(2.0, 30)
    monkeypatch.setattr(cache, "_apply", apply)
    snap = cache.snapshot(2.0, 30)
    assert snap.runners == [] and snap.devices[0].reserved == 0
    assert view(snap) == view(state.snapshot(2.0, 30))


def test_a_clock_set_back_finds_a_device_that_had_just_lapsed(db: redis.Redis) -> None:
    state, cache = ClusterState(db), SnapshotCache(db)
    for i in range(2):
        state.register_device(vgpu(i))
    beat = float(db.hget(keys.device(vgpu(0).id), "heartbeat") or 0)
    db.hset(keys.device(vgpu(1).id), "heartbeat", beat - 1.0)  # read whole by the first look
    assert [d.id for d in cache.snapshot(beat + 29.5, 30).devices] == [vgpu(0).id]
    state.heartbeat({vgpu(0).id: 4 * GIB})  # alive before and after: no join, no leave
    now = beat + 28.5  # Redis's clock, resynced, is a second behind the last look's
    assert view(cache.snapshot(now, 30)) == view(state.snapshot(now, 30))
    assert vgpu(1).id in cache.snapshot(now, 30).device_by_id


def test_a_beat_that_changes_nothing_is_logged_once_its_last_logged_one_is_quiet_s_old(
    db: redis.Redis,
) -> None:
    """1,000 devices beating every second must not each log every beat: a beat goes in the
    change log when the device's free memory changed, or when the last one logged is
    quiet_s old; every beat is written all the same, and the cache sees the device alive."""
    state, cache = ClusterState(db), SnapshotCache(db)
    state.register_device(vgpu(0))

    def logged() -> int:
        return int(db.get(keys.CHANGES_N) or 0)

    state.heartbeat({vgpu(0).id: 4 * GIB}, "", 60.0)  # its first beat: logged
    first = float(db.hget(keys.device(vgpu(0).id), "heartbeat") or 0)
    before = logged()
    state.heartbeat({vgpu(0).id: 4 * GIB}, "", 60.0)  # nothing changed, 0 s after
    assert logged() == before
    assert float(db.hget(keys.device(vgpu(0).id), "heartbeat") or 0) >= first
    assert db.zscore(keys.HEARTBEATS, vgpu(0).id) == float(
        db.hget(keys.device(vgpu(0).id), "heartbeat") or 0
    )
    state.heartbeat({vgpu(0).id: 5 * GIB}, "", 60.0)  # its free memory changed
    assert logged() == before + 1
    state.heartbeat({vgpu(0).id: 5 * GIB}, "", 0.0)  # quiet 0: every beat is logged
    assert logged() == before + 2
    assert view(cache.snapshot(first, 30)) == view(state.snapshot(first, 30))
    assert [d.id for d in cache.snapshot(first, 30).devices] == [vgpu(0).id]


def test_a_device_whose_last_beats_went_unlogged_is_alive_as_its_beats_say(
    db: redis.Redis,
) -> None:
    """The cache took in a logged beat; the device's later beats changed nothing and were
    not logged. Judged on the cached beat alone it would be dead while the reap (which
    reads ggufq:heartbeats) counts it alive: the cache reads its beat there first."""
    state, cache = ClusterState(db), SnapshotCache(db)
    state.register_device(vgpu(0))
    device = keys.device(vgpu(0).id)
    state.heartbeat({vgpu(0).id: 4 * GIB}, "", 60.0)
    cached = float(db.hget(device, "heartbeat") or 0)
    assert [d.id for d in cache.snapshot(cached, 30).devices] == [vgpu(0).id]
    before = int(db.get(keys.CHANGES_N) or 0)
    state.heartbeat({vgpu(0).id: 4 * GIB}, "", 60.0)  # written, not logged
    assert int(db.get(keys.CHANGES_N) or 0) == before
    later = cached + 20  # as a beat 20 s on would stamp it, unlogged too
    db.zadd(keys.HEARTBEATS, {vgpu(0).id: later})
    db.hset(device, "heartbeat", later)
    now = cached + 35  # the cached beat is 35 s old, the device's 15 s: TTL 30
    assert [d.id for d in cache.snapshot(now, 30).devices] == [vgpu(0).id]
    assert view(cache.snapshot(now, 30)) == view(state.snapshot(now, 30))
    assert cache.snapshot(later + 31, 30).devices == []  # beats that stopped: dead


def test_the_mean_demand_of_loaded_models_is_a_full_read_s(
    db: redis.Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a reload weighs when placement rates victims (Snapshot.mean_live_demand): the
    cache's count leaves out a model whose only runner is on a device that lapsed, as a
    full read does, and a demand entry it cannot read counts as none, with a warning,
    instead of failing every eviction."""
    monkeypatch.setattr(records, "_UNREADABLE", set())  # warned once a process: here
    state, cache = ClusterState(db), SnapshotCache(db)
    for i in range(3):
        state.register_device(vgpu(i))
    for n, model in enumerate(("a", "b", "c")):
        fields = {"model": model, "config_key": "c"}
        state.reserve(f"r{n}", f"p{n}", {vgpu(n).id: GIB}, fields, 1.0, 30)
    beat = float(db.hget(keys.device(vgpu(0).id), "heartbeat") or 0)
    db.hset(keys.DEMAND, mapping={"a": f"4.0:{beat}", "b": f"9.0:{beat}", "c": "garbage"})
    db.hset(keys.device(vgpu(1).id), "heartbeat", beat - 20.0)  # b's device lapses first
    now = beat + 15.0
    full, cached = state.snapshot(now, 30), cache.snapshot(now, 30)
    assert sorted(d.id for d in cached.devices) == [vgpu(0).id, vgpu(2).id]
    assert "b" in cached.all_live_by_model  # its runner is still known, on a lapsed device
    assert full.mean_live_demand == pytest.approx(cached.mean_live_demand)
    assert cached.mean_live_demand == pytest.approx(cached.demand["a"] / 2)  # a and c
    assert dict(cached.demand) == pytest.approx(full.demand)  # c in neither
    assert "model 'c''s demand 'garbage' cannot be read: none counted" in caplog.text

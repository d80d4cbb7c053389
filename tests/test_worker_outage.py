"""A worker's unload when Redis drops a reply: against a real Redis (database 1), with a
recording fake of the runner (the part of a runner an unload touches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.errors import LoadFailed
from scheduler.gguf.registry import Registry
from scheduler.protocol import JobRequest, Placement, RunnerConfig
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.placement_state import PlacementState
from tests.test_state import GIB, ended, vgpu
from workers.handback import HandBack, RunnerGone
from workers.runtime import WorkerRuntime


@dataclass
class FakeRunner:
    id: str
    device_ids: list[str]
    model: str = "fake"
    closed: list[int] = field(default_factory=list)
    keep_alive_s: float = 300.0
    load_duration_ns: int = 1
    stopped: str | None = None  # its decode loop runs (workers.resident.Resident.stopped)

    def close(self) -> None:
        self.closed.append(1)


def test_an_unload_whose_reply_redis_lost_is_finished_on_the_next_try(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = vgpu(0)
    runtime = WorkerRuntime(Settings(), db, [device], Registry(tmp_path))
    runtime.state.register_device(device)
    assert PlacementState(db).reserve("r", "p1", {device.id: GIB}, {"model": "m"}, 100.0, 10)
    assert ended(runtime.state, "j") == 0
    runner = FakeRunner("r", [device.id])
    runtime.runners["r"] = runner  # type: ignore[assignment]
    begin = runtime.state.begin_unload

    def reply_lost(*args: Any, **kwargs: Any) -> bool:
        begin(*args, **kwargs)  # Redis marks it unloading ...
        raise redis.ConnectionError("Connection reset by peer")  # ... and the reply is lost

    monkeypatch.setattr(runtime.state, "begin_unload", reply_lost)
    with pytest.raises(redis.ConnectionError):
        runtime._unload("r")
    monkeypatch.undo()
    assert db.hget(keys.runner("r"), "state") == b"unloading"
    assert runtime._unload("r")  # its own earlier try: carried through, not refused
    assert runner.closed == [1]
    assert not db.exists(keys.runner("r")) and db.hlen(keys.reservations(device.id)) == 0
    runtime.chunks.close()


def about_to_load(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[WorkerRuntime, JobRequest, Placement, FakeRunner]:
    """A worker, and a job whose runner "r" placement reserved and the worker is to load
    (its load gives a FakeRunner)."""
    device = vgpu(0)
    runtime = WorkerRuntime(Settings(), db, [device], Registry(tmp_path))
    runtime.state.register_device(device)
    assert PlacementState(db).reserve("r", "p1", {device.id: GIB}, {"model": "m"}, 100.0, 10)
    req = JobRequest(model="m", prompt="hi", submitted_at=1.0)
    placement = Placement(id="p1", runner_id="r", device_id=device.id, config=RunnerConfig(512))
    runner = FakeRunner("r", [device.id])
    monkeypatch.setattr(runtime, "_load", lambda *_args: runner)
    return runtime, req, placement, runner


def test_a_ready_that_redis_missed_is_written_once_it_is_back(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis crashed as a load ended: the runner's "ready" did not land. The job that
    loaded it goes on, and the write is made once Redis answers (it stayed "loading" for
    good: never evictable, refused by the fast path; a chaos trial found one)."""
    runtime, req, placement, runner = about_to_load(db, tmp_path, monkeypatch)
    update = runtime.state.update_runner

    def redis_crashed(*_args: Any, **_kwargs: Any) -> bool:
        raise redis.ConnectionError("Error while reading: Connection reset by peer")

    monkeypatch.setattr(runtime.state, "update_runner", redis_crashed)
    assert runtime._runner_for(req, placement)[0] is runner  # the job goes on
    assert db.hget(keys.runner("r"), "state") == b"loading"
    monkeypatch.setattr(runtime.state, "update_runner", update)  # Redis is back
    assert runtime.backlog.drain() == 2  # its "ready", then its load counted
    assert db.hget(keys.runner("r"), "state") == b"ready"
    assert runtime.state.begin_unload("r", force=True)  # a late "ready" never undoes it
    assert runtime.state.update_runner("r", {"state": "ready", "worker": "w"})
    assert db.hmget(keys.runner("r"), ["state", "worker"]) == [b"unloading", b"w"]
    runtime.chunks.close()


def test_a_job_that_arrives_as_redis_restarts_waits_for_it_to_load_its_runner(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its runner's record is read as Redis goes away: the job waits for Redis and loads
    the runner (it failed, 'Connection reset by peer', in a chaos trial of a crash)."""
    runtime, req, placement, runner = about_to_load(db, tmp_path, monkeypatch)
    phase, tries = runtime.state.runner_phase, []

    def back_on_the_second_try(runner_id: str) -> str | None:
        tries.append(runner_id)
        if len(tries) == 1:
            raise redis.ConnectionError("Error while reading: Connection reset by peer")
        return phase(runner_id)

    monkeypatch.setattr(runtime.state, "runner_phase", back_on_the_second_try)
    assert runtime._runner_for(req, placement)[0] is runner
    assert tries == ["r", "r"] and db.hget(keys.runner("r"), "state") == b"ready"
    runtime.chunks.close()


def test_jobs_waiting_on_a_runner_whose_load_failed_end_as_its_first_did(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's load failed here (out of GPU memory, say) and it was released: a job
    that waited on it is handed back avoiding this device, as the first was, not placed
    again onto it as if the runner had merely gone; at its second try it fails saying why."""
    runtime, req, placement, _runner = about_to_load(db, tmp_path, monkeypatch)
    monkeypatch.undo()  # the real load, which fails

    def out_of_memory(*_args: Any) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr("workers.residency.open_runner", out_of_memory)
    for _job in range(2):  # the first job, then one that waited on the same runner
        with pytest.raises(HandBack, match="out of memory") as raised:
            runtime._runner_for(req, placement)
        assert raised.value.avoid_here and not isinstance(raised.value, RunnerGone)
        assert not db.exists(keys.runner("r"))
    with pytest.raises(LoadFailed, match="out of memory"):
        runtime._runner_for(req.model_copy(update={"attempt": 1}), placement)
    runtime.chunks.close()


def test_an_unload_placement_asked_for_as_redis_went_away_is_tried_again(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement asked to unload an idle runner (its control command runs in a thread of
    its own) as Redis went away: the unload is tried again by the expiry loop, not lost
    with the thread (the runner stayed loaded, its expiry cleared, for good)."""
    runtime, req, placement, runner = about_to_load(db, tmp_path, monkeypatch)
    runtime._runner_for(req, placement)
    assert ended(runtime.state, "j") == 0  # its one job ended: idle
    begin = runtime.state.begin_unload

    def redis_away(*_args: Any, **_kwargs: Any) -> bool:
        raise redis.ConnectionError("Error 111 connecting: Connection refused")

    monkeypatch.setattr(runtime.state, "begin_unload", redis_away)
    assert not runtime.request_unload("r")  # no exception: the thread would die with it
    monkeypatch.setattr(runtime.state, "begin_unload", begin)  # Redis is back
    assert runtime._expiry.next_at() is not None  # the unload is due again
    monkeypatch.setattr(runtime, "clock", lambda: 1e12)
    runtime._expire_due()
    assert runner.closed == [1] and not db.exists(keys.runner("r"))
    # counted as the eviction it was, though the expiry loop carried it out
    assert db.hget(keys.STATS, "evictions|fake") == b"1"
    assert db.hget(keys.STATS, "expiries|fake") is None
    runtime.chunks.close()


def test_a_ready_that_redis_acknowledged_and_lost_is_written_again(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash with appendfsync everysec lost the "ready" that Redis had acknowledged: the
    worker's look finds its loaded runner held as loading and writes "ready" again."""
    runtime, req, placement, runner = about_to_load(db, tmp_path, monkeypatch)
    assert runtime._runner_for(req, placement)[0] is runner
    assert runtime.mark_loaded_ready() == 0  # ready: nothing to do
    db.hset(keys.runner("r"), "state", "loading")  # Redis came back from an older state
    assert runtime.mark_loaded_ready() == 1
    assert db.hget(keys.runner("r"), "state") == b"ready"
    assert runtime.state.begin_unload("r", force=True)
    assert runtime.mark_loaded_ready() == 0  # an unload under way is left alone
    assert db.hget(keys.runner("r"), "state") == b"unloading"
    runtime.chunks.close()

"""Parked jobs on a real stack: they wait for memory, are woken by events, never block
jobs for a loaded model, and keep the queue bounded."""

from __future__ import annotations

import pytest

from api_client import Client, InvalidRequest, JobCancelled, ServerBusy
from scheduler.gguf.estimate import estimate_bytes
from scheduler.gguf.metadata import read_model_info
from scheduler.local.stack import LocalStack
from scheduler.protocol import RunnerConfig
from scheduler.store import keys
from tests.conftest import settings_from, stack_env, wait_for
from tests.held_worker import HOLD, release
from tests.tinymodel import write_slow_model


@pytest.fixture(scope="module")
def one_slot_stack(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A virtual GPU that holds one runner of `slow` at a time; events are the only waker."""
    root = tmp_path_factory.mktemp("parking")
    models = root / "models"
    models.mkdir()
    path = write_slow_model(models / "slow.gguf")
    info = read_model_info(path)
    big = estimate_bytes(info, RunnerConfig(8192, flash_attn=True))
    small = estimate_bytes(info, RunnerConfig(4096, flash_attn=True))
    env = {
        **stack_env(models, root / "state", host="parkhost"),
        "GGUFQ_PARK_SWEEP_S": "600",
        "GGUFQ_MAX_QUEUE": "1",
    }
    settings = settings_from(env, None)
    worker = ["--virtual-gpu", str(big + small // 2)]
    with LocalStack(
        settings,
        worker_args=worker,
        log_dir=root / "logs",
        extra_env=env,
        worker_module="tests.held_worker",  # HOLD: jobs stay running until released
    ) as st:
        with Client(st.redis_url, settings=settings, timeout=120) as client:
            yield client


LONG = {"temperature": 0, "num_predict": 2000, "num_ctx": 8192}


def counted(client: Client, field: str) -> float:
    """A counter of the cluster's (scheduler/store/stats.py) as the workers left it."""
    return float(client.r.hget(keys.STATS, field) or 0)  # type: ignore[arg-type]


def parked(client: Client) -> list[str]:
    return [j.id for j in client.jobs() if j.state == "parked"]


def test_parked_job_waits_then_runs_and_loaded_model_is_not_blocked(
    one_slot_stack: Client,
) -> None:
    client = one_slot_stack
    evictions = counted(client, "evictions|slow")
    # held until released, then a few tokens more: its length is the event, not the
    # machine's speed (2,000 tokens of `slow` outlasted result()'s 120 s on a busy machine)
    a = client.submit("slow", f"{HOLD} a", options={**LONG, "num_predict": 8})
    assert wait_for(lambda: any(r.in_flight == 1 and r.state == "ready" for r in client.ps()))
    b = client.submit("slow", "b", options={"num_ctx": 4096, "num_predict": 4})
    assert wait_for(lambda: parked(client) == [b.id])
    rows = {j.id: j for j in client.jobs()}
    assert rows[b.id].model_position == 1 and rows[b.id].position == 1
    assert rows[a.id].state == "running" and rows[a.id].device == "vgpu:parkhost:0"
    # A job for the loaded configuration is routed at once, past the parked one.
    c = client.submit("slow", "c", options={**LONG, "num_predict": 4})
    assert wait_for(lambda: sum(r.in_flight for r in client.ps()) == 2)
    assert parked(client) == [b.id]
    # The queue holds one job (GGUFQ_MAX_QUEUE=1): another that must wait is refused.
    with pytest.raises(ServerBusy, match="max_queue 1"):
        client.generate("slow", "d", options={"num_ctx": 6144, "num_predict": 4})
    release(client.r, a.id)
    assert a.result().done and c.result().done
    # A's runner went idle (job_finished) → evicted (runner_unloaded) → B loaded: events only.
    result = b.result(timeout=60)
    assert result.done and result.load_duration and result.load_duration > 0
    (runner,) = client.ps()
    assert runner.context_length == 4096
    assert client.jobs() == []
    assert wait_for(lambda: counted(client, "evictions|slow") == evictions + 1)  # A's runner


def test_load_pin_and_unload(one_slot_stack: Client) -> None:
    client = one_slot_stack
    unloads = counted(client, "unloads|slow")
    (device,) = client.devices()
    loaded = client.load("slow", device=device.id, keep_alive=-1, options={"num_ctx": 4096})
    assert loaded.device == device.id and loaded.done_reason == "load"
    assert [r.expires_at for r in client.ps()] == [-1]
    with pytest.raises(InvalidRequest, match="'vgpu:nowhere:0' is not alive"):
        client.load("slow", device="vgpu:nowhere:0")
    assert client.unload("slow")
    assert wait_for(lambda: not client.ps())
    assert wait_for(lambda: counted(client, "unloads|slow") == unloads + 1)
    assert client.unload("slow") == []


def test_cancel_a_parked_and_a_running_job(one_slot_stack: Client) -> None:
    client = one_slot_stack
    a = client.submit("slow", f"{HOLD} a", options=LONG)  # runs until cancelled
    assert wait_for(lambda: any(r.in_flight == 1 and r.state == "ready" for r in client.ps()))
    b = client.submit("slow", "b", options={"num_ctx": 4096, "num_predict": 4})
    assert wait_for(lambda: parked(client) == [b.id])
    b.cancel()  # parked: it leaves the queue and never starts
    assert wait_for(lambda: parked(client) == [])
    with pytest.raises(JobCancelled, match="before it started"):
        b.result()
    assert b.status() == "REVOKED"
    # leaving a stream early cancels its job, as a client that disconnects does
    for _chunk in a.stream():
        break
    with pytest.raises(JobCancelled, match="generated tokens"):
        a.result()
    assert a.status() == "REVOKED"
    # the runner stays loaded and serves the next job
    assert wait_for(lambda: [r.in_flight for r in client.ps()] == [0])
    after = client.generate("slow", "c", options={**LONG, "num_predict": 4})
    assert after.done and after.load_duration == 0

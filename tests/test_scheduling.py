"""Scheduling beyond one runner per model, on a real stack with virtual GPUs: replicas of a
busy model grow onto free devices and shrink by keep_alive, a conversation keeps landing on
the replica that holds its cache, and one tenant's flood does not hold up another's jobs."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_client import Client
from api_client.job import Job
from scheduler.local.stack import LocalStack
from scheduler.store import keys
from tests.conftest import ggufq, settings_from, stack_env, wait_for
from tests.tinymodel import write_slow_model

SLOW = {"num_predict": 300, "temperature": 0}  # about 0.3 s of decoding on the slow model


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    here = tmp_path_factory.mktemp("scheduling-models")
    shutil.copy(models_dir / "tiny.gguf", here / "tiny.gguf")
    write_slow_model(here / "slow.gguf")
    return here


def three_gpus(models: Path, tmp_path: Path, **env: str) -> tuple[LocalStack, dict[str, str]]:
    full = {**stack_env(models, tmp_path / "state", host="rep"), **env}
    settings = settings_from(full, None)
    worker = ["--virtual-gpu", "1GiB", "--virtual-gpu", "1GiB", "--virtual-gpu", "1GiB"]
    return LocalStack(settings, worker_args=worker, log_dir=tmp_path / "logs", extra_env=full), full


@pytest.fixture()
def replicas_stack(models: Path, tmp_path: Path) -> Iterator[tuple[Client, dict[str, str]]]:
    stack, env = three_gpus(
        models, tmp_path, GGUFQ_MAX_REPLICAS="3", GGUFQ_KEEP_ALIVE_S="3", GGUFQ_NUM_PARALLEL="1"
    )
    with stack as st, Client(st.redis_url, settings=st.settings, timeout=120) as client:
        yield client, {**env, "GGUFQ_REDIS_URL": st.redis_url}


def test_a_burst_grows_replicas_onto_free_devices_and_they_shrink_after_keep_alive(
    replicas_stack: tuple[Client, dict[str, str]],
) -> None:
    client, _env = replicas_stack
    jobs = [client.submit("slow", f"burst {i}", options=SLOW) for i in range(9)]
    results = [job.result() for job in jobs]
    # one slot per runner: while all were busy and jobs waited, replicas loaded elsewhere,
    # never more than GGUFQ_MAX_REPLICAS
    assert {r.device for r in results} == {"vgpu:rep:0", "vgpu:rep:1", "vgpu:rep:2"}
    runners = [r for r in client.ps() if r.model == "slow"]
    assert len(runners) == 3 and len({r.config_key for r in runners}) == 1
    # keep_alive (3 s here) scales them down as any runner
    assert wait_for(lambda: not client.ps(), timeout=30)
    assert all(d.reserved == 0 for d in client.devices())


def test_a_replica_floor_and_a_conversation_that_stays_on_its_replica(
    replicas_stack: tuple[Client, dict[str, str]],
) -> None:
    client, env = replicas_stack
    out = ggufq("load", "tiny", "--replicas", "2", env=env)
    assert out.returncode == 0, out.stderr
    assert "2 replicas of tiny" in out.stdout
    runners = [r for r in client.ps() if r.model == "tiny"]
    assert len(runners) == 2 and len({d for r in runners for d in r.devices}) == 2
    assert all(r.expires_at < 0 for r in runners)  # a floor: kept until unloaded
    ps = ggufq("ps", env=env).stdout
    assert "1/2" in ps and "2/2" in ps
    # each turn repeats the conversation so far: it lands where the last turn ran, whose
    # slot still holds the conversation's tokens (turns in a row: the least recently used
    # replica would be the other one every time)
    talks: dict[str, list[dict[str, str]]] = {
        "a": [{"role": "system", "content": "You are terse and talk about the sea."}],
        "b": [{"role": "system", "content": "You answer in lists about mountains."}],
    }
    where: dict[str, set[str]] = {"a": set(), "b": set()}
    for name, messages in talks.items():
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} of {name}"})
            result = client.chat("tiny", messages, options={"num_predict": 8, "temperature": 0})
            assert result.message is not None
            messages.append({"role": "assistant", "content": result.message.content})
            assert result.device is not None
            where[name].add(result.device)
    assert len(where["a"]) == 1 and len(where["b"]) == 1
    client.unload("tiny")
    assert wait_for(lambda: not client.ps(), timeout=30)


def test_one_tenants_flood_does_not_hold_up_another_tenants_jobs(
    models: Path, tmp_path: Path
) -> None:
    # one GPU, one runner with one slot (no replicas), and (by default) one job let wait at
    # it: the rest wait in placement, served in turn across tenants
    full = {**stack_env(models, tmp_path / "state", host="fair"), "GGUFQ_MAX_REPLICAS": "1"}
    settings = settings_from(full, None)
    stack = LocalStack(
        settings, worker_args=["--virtual-gpu", "1GiB"], log_dir=tmp_path / "logs", extra_env=full
    )
    with stack as st:
        heavy = Client(st.redis_url, settings=st.settings, timeout=180, tenant="heavy")
        light = Client(st.redis_url, settings=st.settings, timeout=180, tenant="light")
        with heavy, light:
            ended: list[str] = []
            lock = threading.Lock()

            def wait(name: str, job: Job) -> None:
                job.result()
                with lock:
                    ended.append(name)

            # the flood: as many interactive jobs as the other tenant's (fairness across
            # tenants, not priority, must let the light tenant through)
            # long enough (about a second each) that the order jobs end in is not the
            # order their readers happen to notice it
            long = {**SLOW, "num_predict": 1000}
            flood = [heavy.submit("slow", f"flood {i}", options=long) for i in range(12)]
            waiters = [threading.Thread(target=wait, args=("heavy", j)) for j in flood]
            for t in waiters:
                t.start()
            assert wait_for(lambda: heavy.r.hlen(keys.RUNNING) > 0, timeout=60)
            # the flood waits in placement (no fixed pause: a fast machine ends jobs in it)
            assert wait_for(lambda: any(j.state == "parked" for j in heavy.jobs()), 60)
            with lock:
                ended_before = len(ended)  # flood jobs that ended before it came
            mine = light.submit("slow", "a short question", options=SLOW)
            wait("light", mine)
            for t in waiters:
                t.join(180)
            assert len(ended) == 13
            # ahead of it: the job running and the one waiting at the runner when it came,
            # and at most one more that placement sent before it; first come first served
            # would have put all 12 ahead
            assert ended.index("light") - ended_before <= 3, ended

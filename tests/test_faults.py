"""Faults on a real stack (real Redis, placement, Celery workers, llama.cpp on tiny models):
Redis losing its data, a worker stalled past the device TTL, a worker restarted within it.
Every job in flight gets an outcome, none runs twice or writes twice, and the cluster serves
again by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from api_client import Client, GgufqError, Job, JobFailed
from scheduler.local.stack import LocalStack
from scheduler.protocol import JobRequest
from scheduler.settings import Settings
from scheduler.store import keys
from tests.conftest import settings_from, stack_env, wait_for
from tests.held_worker import HOLD
from tests.tinymodel import write_slow_model

HELD_WORKER = "tests.held_worker"

LONG = {"temperature": 0, "num_predict": 6000, "num_ctx": 8192}
SHORT = {"temperature": 0, "num_predict": 4, "num_ctx": 8192}


Hosts = tuple[LocalStack, subprocess.Popen[bytes], Settings]


@contextmanager
def held_hosts(tmp_path: Path, **settings_env: str) -> Iterator[Hosts]:
    """A stack on host h1 (a 2 GiB virtual GPU) and a second worker, h2, with the smaller
    GPU: binpack sends the first job of the slow model there. h2 holds jobs whose prompt
    starts with HOLD: (tests/held_worker.py). Device TTL 5 s, heartbeats every 0.5 s, one
    runner of a model (b waits behind a at a's runner: no replica elsewhere);
    ``settings_env`` sets more."""
    models = tmp_path / "models"
    models.mkdir()
    write_slow_model(models / "slow.gguf")
    env = {**stack_env(models, tmp_path / "state", host="h1"), "GGUFQ_MAX_REPLICAS": "1"}
    env.update(settings_env)
    settings = settings_from(env, None)
    with LocalStack(
        settings, worker_args=["--virtual-gpu", "2GiB"], log_dir=tmp_path / "logs", extra_env=env
    ) as st:
        h2 = st.add_worker(
            "worker-h2", ["--virtual-gpu", "1GiB"], {"GGUFQ_HOST_ID": "h2"}, HELD_WORKER
        )
        yield st, h2, settings


@pytest.fixture()
def two_hosts(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """:func:`held_hosts` with the device TTL of the test's ``ttl`` parameter (5 s); a job
    that streamed fails when its worker dies, as it does once its resumes are used up
    (tests/test_midstream.py has it go on elsewhere)."""
    ttl = str(getattr(request, "param", 5))
    with held_hosts(tmp_path, GGUFQ_DEVICE_TTL_S=ttl, GGUFQ_RESUME_MAX="0") as hosts:
        yield hosts


def stream_seqs(client: Client, job_id: str) -> list[int]:
    entries = client.r.xrange(keys.job_chunks(job_id))
    return [json.loads(fields[b"c"])["seq"] for _id, fields in entries]


def finals(client: Client, job_id: str) -> int:
    entries = client.r.xrange(keys.job_chunks(job_id))
    return sum(bool(json.loads(fields[b"c"]).get("done")) for _id, fields in entries)


def busy_on_h2(client: Client) -> tuple[object, object]:
    """a streamed on h2's runner and is held there, running (tests/held_worker.py); b waits
    behind it for the one slot (nothing streamed)."""
    assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
    a = client.submit("slow", f"{HOLD} a", options=LONG)
    next(iter(a.stream(cancel_on_close=False)))
    b = client.submit("slow", "b", options={**LONG, "num_predict": 8})
    assert wait_for(lambda: [r.in_flight for r in client.ps()] == [2])
    (runner,) = client.ps()
    assert runner.devices.keys() == {"vgpu:h2:0"}
    return a, b


def test_a_worker_stalled_past_the_ttl_lets_go_of_what_was_re_placed(two_hosts: Hosts) -> None:
    st, h2, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        a, b = busy_on_h2(client)
        h2.send_signal(signal.SIGSTOP)  # as a long GIL-holding call or a paused VM does
        try:
            with pytest.raises(JobFailed, match=r"worker ggufq-vgpu0@h2 \(vgpu:h2:0\) stopped"):
                a.result(timeout=60)  # type: ignore[attr-defined]
            result = b.result(timeout=60)  # type: ignore[attr-defined]
            assert result.done and result.device == "vgpu:h1:0"
        finally:
            h2.send_signal(signal.SIGCONT)
        # it comes back: registers again by itself and serves
        assert wait_for(lambda: len(client.devices()) == 2, timeout=30)
        again = client.generate("slow", "c", options=SHORT, device="vgpu:h2:0")
        assert again.done and again.device == "vgpu:h2:0"
        # and it wrote nothing more into the jobs placement took back from it
        time.sleep(1.0)
        for job in (a, b):
            seqs = stream_seqs(client, job.id)  # type: ignore[attr-defined]
            assert seqs == list(range(1, len(seqs) + 1)), f"gap or duplicate: {seqs}"
            assert finals(client, job.id) == 1  # type: ignore[attr-defined]
        assert seqs[-1] == len(seqs)
    log = (st.log_dir or Path()) / "worker-h2.log"
    assert "registering them again" in log.read_text()


@pytest.mark.parametrize("two_hosts", [120], indirect=True)  # a TTL no result waits out
def test_a_worker_restarted_within_the_ttl_reaps_its_predecessor(two_hosts: Hosts) -> None:
    st, h2, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        a, b = busy_on_h2(client)
        h2.send_signal(signal.SIGKILL)
        h2.wait(10)
        # as compose's restart policy does after an OOM kill: the same host, at once
        st.add_worker("worker-h2-again", ["--virtual-gpu", "1GiB"], {"GGUFQ_HOST_ID": "h2"})
        # the outcomes come from the new worker's start: waiting out the TTL (120 s) would
        # end these waits with JobTimeout instead
        with pytest.raises(JobFailed, match="stopped heartbeating"):
            a.result(timeout=45)  # type: ignore[attr-defined]
        assert b.result(timeout=45).done  # type: ignore[attr-defined]
        # no phantom runner of the dead process holds memory or is asked to unload forever
        assert wait_for(lambda: len(client.devices()) == 2, timeout=30)
        assert wait_for(lambda: all(r.worker != "" for r in client.ps()), timeout=30)
        phantoms = [r for r in client.ps() if r.state == "loading" and r.in_flight == 0]
        assert not phantoms


@pytest.mark.parametrize("two_hosts", [120], indirect=True)  # no reaping to hide behind
def test_redis_losing_its_data_heals_by_itself(two_hosts: Hosts) -> None:
    st, _h2, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
        assert client.generate("slow", "x", options=SHORT).done
        raw = redis.Redis.from_url(st.redis_url)
        raw.flushall()  # as a restart of a Redis that keeps nothing on disk
        raw.close()
        # every device registers again (bench/chaos.py measures how soon)
        assert wait_for(lambda: len(client.devices()) == 2, timeout=30)
        assert client.generate("slow", "y", options=SHORT).done


def test_malformed_messages_on_every_queue_and_channel_stop_nothing(two_hosts: Hosts) -> None:
    st, h2, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
        raw = redis.Redis.from_url(st.redis_url)
        for channel in (keys.CANCELS, keys.EVENTS):
            raw.publish(channel, b"\xff\xfe not utf-8 \x80")
        for queue in (keys.PLACEMENT_QUEUE, keys.device_queue("vgpu:h2:0")):
            raw.lpush(queue, b"\xff not a celery envelope")
            raw.lpush(queue, b'{"body": "not base64", "headers": {}}')
        raw.close()
        # every process is alive, cancellation still reaches a running job, jobs still run
        time.sleep(1.0)
        assert st.alive() and h2.poll() is None
        long = client.submit("slow", f"{HOLD} long", options=LONG)
        next(iter(long.stream(cancel_on_close=False)))
        long.cancel()
        with pytest.raises(GgufqError, match="cancelled"):
            long.result(timeout=60)
        for device in ("vgpu:h1:0", "vgpu:h2:0"):
            assert client.generate("slow", "z", options=SHORT, device=device).done


def test_no_job_runs_twice_when_the_broker_redelivers_quickly(tmp_path: Path) -> None:
    """A visibility timeout of 1 s (kombu looks every second here): workers keep no record
    of the messages they took, so none comes back to run twice, and placement's sweep
    sends a job again only when it finds it neither queued nor started. Two threads and one
    slot: a holds the slot, b waits for it in the second thread, and c waits in the queue
    (a worker takes no more than it can start)."""
    models = tmp_path / "models"
    models.mkdir()
    write_slow_model(models / "slow.gguf")
    env = stack_env(models, tmp_path / "state", host="vt")
    env |= {
        "GGUFQ_BROKER_VISIBILITY_TIMEOUT_S": "1",
        "GGUFQ_BROKER_RESTORE_INTERVAL_S": "1",
        "GGUFQ_WORKER_THREADS": "2",
        "GGUFQ_MAX_LOADED_MODELS": "1",
    }
    settings = settings_from(env, None)
    with LocalStack(
        settings, log_dir=tmp_path / "logs", extra_env=env, worker_module=HELD_WORKER
    ) as st:
        with Client(st.redis_url, settings=settings, timeout=120) as client:
            a = client.submit("slow", f"{HOLD} a", options=LONG)  # held until cancelled
            next(iter(a.stream(cancel_on_close=False)))
            b, c = (client.submit("slow", n, options=SHORT) for n in ("b", "c"))
            time.sleep(5)  # several of kombu's sweeps for unacknowledged messages
            a.cancel()
            for job in (b, c):
                assert job.result(timeout=60).eval_count == SHORT["num_predict"]
                seqs = stream_seqs(client, job.id)
                assert seqs == list(range(1, len(seqs) + 1)) and finals(client, job.id) == 1
    log = (tmp_path / "logs" / "worker.log").read_text(errors="replace")
    for job in (b, c):
        assert log.count(f"ggufq.run[{job.id}] succeeded") == 1


READER = """
import sys
from api_client import Client
with Client() as client:
    job = client.submit("slow", "HOLD: a reader that dies", options={LONG!r})
    for chunk in job.stream():
        print(job.id, flush=True)
"""


def test_a_client_killed_mid_stream_has_its_job_cancelled(two_hosts: Hosts) -> None:
    st, _h2, settings = two_hosts
    env = {**os.environ, **st.extra_env, "GGUFQ_REDIS_URL": st.redis_url}
    reader = subprocess.Popen(
        [sys.executable, "-c", READER.replace("{LONG!r}", repr(LONG))],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    job_id = reader.stdout.readline().split()[0]  # it streams
    reader.kill()  # no goodbye: no cancel sent, its lease lapses
    reader.wait(10)
    reader.stdout.close()
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        job = Job(client, JobRequest(id=job_id, model="slow"))
        with pytest.raises(GgufqError, match="cancel"):
            job.result(timeout=60)
        # the runner keeps serving
        assert client.generate("slow", "next", options=SHORT).done


def test_sigkill_worker_mid_job(two_hosts: Hosts) -> None:
    """A worker killed mid-job loses no job silently."""
    st, victim, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        a, b = busy_on_h2(client)
        victim.send_signal(signal.SIGKILL)
        # a had streamed: it ends with an error that says what happened
        with pytest.raises(JobFailed, match=r"worker ggufq-vgpu0@h2 \(vgpu:h2:0\) stopped"):
            a.result(timeout=60)  # type: ignore[attr-defined]
        # b had not: it runs again, once, on the other host
        result = b.result(timeout=60)  # type: ignore[attr-defined]
        assert result.done and result.device == "vgpu:h1:0"
        # the dead device is gone with its runner and reservation
        assert [d.id for d in client.devices()] == ["vgpu:h1:0"]
        (runner,) = client.ps()
        assert runner.devices.keys() == {"vgpu:h1:0"}
        (device,) = client.devices()
        assert device.reserved == runner.bytes


def test_a_job_sent_on_the_fast_path_has_an_outcome_when_its_worker_is_killed(
    two_hosts: Hosts,
) -> None:
    """The fast path writes placement's records, so recovery treats its jobs alike: a job
    that streamed ends with an error, and the next job is not sent to the dead device."""
    st, victim, settings = two_hosts
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
        client.generate("slow", "warm", options=SHORT)  # loads on h2; publishes its route
        job = client.submit("slow", f"{HOLD} a", options=LONG)  # held on h2, running
        assert client.r.get(keys.job_placed(job.id)).startswith(b"fast:")
        next(iter(job.stream(cancel_on_close=False)))
        victim.send_signal(signal.SIGKILL)
        with pytest.raises(JobFailed, match=r"worker ggufq-vgpu0@h2 \(vgpu:h2:0\) stopped"):
            job.result(timeout=60)
        assert finals(client, job.id) == 1
        # the route to the dead device's runner no longer takes jobs: this one goes
        # through placement, to the other host
        after = client.submit("slow", "b", options=SHORT)
        assert after.result(timeout=60).device == "vgpu:h1:0"
        assert not client.r.get(keys.job_placed(after.id)).startswith(b"fast:")

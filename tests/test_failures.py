"""Failures on a real stack: a worker killed mid-job loses no job silently."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from api_client import Client, JobFailed
from scheduler.local.stack import LocalStack
from tests.conftest import settings_from, stack_env, wait_for
from tests.tinymodel import write_slow_model

LONG = {"temperature": 0, "num_predict": 6000, "num_ctx": 8192}


def test_sigkill_worker_mid_job(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_slow_model(models / "slow.gguf")
    env = stack_env(models, tmp_path / "state", host="h1")  # device TTL 5 s
    settings = settings_from(env, None)
    logs = tmp_path / "logs"
    # h2's GPU is the smaller: binpack sends the first job there, to the worker we kill
    with LocalStack(
        settings, worker_args=["--virtual-gpu", "2GiB"], log_dir=logs, extra_env=env
    ) as st:
        victim = st.add_worker("worker-h2", ["--virtual-gpu", "1GiB"], {"GGUFQ_HOST_ID": "h2"})
        with Client(st.redis_url, settings=settings, timeout=60) as client:
            assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
            a = client.submit("slow", "a", options=LONG)
            for seen, _chunk in enumerate(a.stream(cancel_on_close=False), 1):
                if seen == 3:
                    break
            # b shares a's runner (one slot): it waits at the worker and streams nothing
            b = client.submit("slow", "b", options={**LONG, "num_predict": 8})
            assert wait_for(lambda: [r.in_flight for r in client.ps()] == [2])
            (runner,) = client.ps()
            assert runner.devices.keys() == {"vgpu:h2:0"}

            victim.send_signal(signal.SIGKILL)

            # a had streamed: it ends with an error that says what happened
            with pytest.raises(JobFailed, match=r"worker ggufq-vgpu0@h2 \(vgpu:h2:0\) stopped"):
                a.result(timeout=60)
            # b had not: it runs again, once, on the other host
            result = b.result(timeout=60)
            assert result.done and result.device == "vgpu:h1:0"
            # the dead device is gone with its runner and reservation
            assert [d.id for d in client.devices()] == ["vgpu:h1:0"]
            (runner,) = client.ps()
            assert runner.devices.keys() == {"vgpu:h1:0"}
            (device,) = client.devices()
            assert device.reserved == runner.bytes

"""Several hosts on one Redis: placement spans them, and losing a host moves new jobs."""

from __future__ import annotations

import signal
from pathlib import Path

from api_client import Client
from scheduler.gguf.estimate import estimate_bytes
from scheduler.gguf.metadata import read_model_info
from scheduler.local.stack import LocalStack
from scheduler.protocol import RunnerConfig
from tests.conftest import settings_from, stack_env, wait_for
from tests.tinymodel import write_tiny_llama

SHORT = {"temperature": 0, "num_predict": 2}


def test_placement_spans_hosts_and_survives_losing_one(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        write_tiny_llama(models / f"{name}.gguf")
    info = read_model_info(models / "alpha.gguf")
    one_runner = estimate_bytes(info, RunnerConfig(2048, flash_attn=True))
    size = str(one_runner * 3 // 2)  # each GPU holds one runner, not two
    env = stack_env(models, tmp_path / "state", host="h1")
    settings = settings_from(env, None)
    logs = tmp_path / "logs"
    with LocalStack(
        settings, worker_args=["--virtual-gpu", size], log_dir=logs, extra_env=env
    ) as st:
        h2 = st.add_worker("worker-h2", ["--virtual-gpu", size], {"GGUFQ_HOST_ID": "h2"})
        with Client(st.redis_url, settings=settings, timeout=60) as client:
            assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
            hosts = {d.id: d.host for d in client.devices()}
            assert hosts == {"vgpu:h1:0": "h1", "vgpu:h2:0": "h2"}
            options = {**SHORT, "num_ctx": 2048}
            a = client.generate("alpha", "a", options=options)
            b = client.generate("beta", "b", options=options)
            assert (a.device, b.device) == ("vgpu:h1:0", "vgpu:h2:0")  # one runner per host

            h2.send_signal(signal.SIGKILL)  # the host goes away without a word

            assert wait_for(lambda: [d.id for d in client.devices()] == ["vgpu:h1:0"])
            again = client.generate("beta", "c", options=options)
            assert again.done and again.device == "vgpu:h1:0"
            assert [r.model for r in client.ps()] == ["beta"]  # alpha's idle runner evicted

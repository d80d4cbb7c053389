"""Virtual GPUs through the whole placement path, and README's first command (`ggufq demo`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from api_client import Client
from scheduler.errors import InvalidRequest, LoadFailed
from scheduler.local.stack import LocalStack
from tests.conftest import ggufq, needs_demo, settings_from, stack_env, wait_for


def test_virtual_gpus_are_advertised_and_preferred(models_dir: Path, tmp_path: Path) -> None:
    env = stack_env(models_dir, tmp_path / "state", host="vhost")
    settings = settings_from(env, None)  # a private Redis for this stack
    worker = ["--virtual-gpu", "1GiB", "--virtual-gpu", "512MiB"]
    with LocalStack(settings, worker_args=worker, log_dir=tmp_path / "logs", extra_env=env) as st:
        with Client(st.redis_url, settings=settings, timeout=60) as client:
            devices = {d.id: d for d in client.devices()}
            assert set(devices) == {"vgpu:vhost:0", "vgpu:vhost:1"}
            assert all(d.virtual and d.kind == "vgpu" for d in devices.values())
            assert devices["vgpu:vhost:0"].total == 2**30
            assert devices["vgpu:vhost:0"].worker == "ggufq-vgpu0+vgpu1@vhost"
            result = client.generate("tiny", "hi", options={"num_predict": 4, "temperature": 0})
            # binpack: the smaller device that holds the model
            assert result.device == "vgpu:vhost:1"
            (runner,) = client.ps()
            reserved = {d.id: d.reserved for d in client.devices()}
            assert reserved == {"vgpu:vhost:0": 0, "vgpu:vhost:1": runner.bytes}
            out = ggufq("devices", env={**env, "GGUFQ_REDIS_URL": st.redis_url})
            line = next(x for x in out.stdout.splitlines() if x.startswith("vgpu:vhost:1"))
            assert line.rstrip().endswith("yes")
            # a failed load on a GPU is tried once more on another one, then reported
            with pytest.raises(LoadFailed, match=r"'alien' on vgpu:vhost:\d \(nor on vgpu:vhost:"):
                client.generate("alien", "hi")
            assert all(r.model == "tiny" for r in client.ps())
            with pytest.raises(InvalidRequest, match="no CPU device is alive"):
                client.generate("tiny", "hi", options={"num_gpu": 0})
            # num_gpu 1: exactly one layer (the output layer) on a GPU; an explicit num_gpu
            # reloads the idle runner, as in Ollama (-1 would have kept it)
            one = client.generate("tiny", "hi", options={"num_gpu": 1, "num_predict": 2})
            assert one.done
            assert [r.n_gpu_layers for r in client.ps()] == [1]
            again = client.generate("tiny", "hi", options={"num_predict": 2})
            assert again.done and [r.n_gpu_layers for r in client.ps()] == [1]


def test_partial_offload_when_the_gpu_is_too_small(models_dir: Path, tmp_path: Path) -> None:
    from scheduler.gguf.estimate import estimate_bytes, partial_table
    from scheduler.gguf.metadata import read_model_info
    from scheduler.protocol import RunnerConfig

    info = read_model_info(models_dir / "tiny.gguf")
    cfg = RunnerConfig(2048, flash_attn=True)  # as runners load (GGUFQ_FLASH_ATTENTION)
    table = partial_table(info, cfg)
    assert table[1] < estimate_bytes(info, cfg)
    env = stack_env(models_dir, tmp_path / "state", host="small")
    settings = settings_from(env, None)
    worker = ["--virtual-gpu", str(table[1])]  # room for the output layer and one block
    with LocalStack(settings, worker_args=worker, log_dir=tmp_path / "logs", extra_env=env) as st:
        with Client(st.redis_url, settings=settings, timeout=60) as client:
            result = client.generate("tiny", "hi", options={"num_predict": 4, "num_ctx": 2048})
            assert result.done and result.device == "vgpu:small:0"
            (runner,) = client.ps()
            assert runner.n_gpu_layers == 2 and runner.bytes == table[1]
            out = ggufq("ps", env={**env, "GGUFQ_REDIS_URL": st.redis_url})
            assert "% CPU/GPU" in out.stdout


def test_a_model_spans_two_gpus_of_one_worker(models_dir: Path, tmp_path: Path) -> None:
    from scheduler.gguf.estimate import estimate_bytes, group_parts
    from scheduler.gguf.metadata import read_model_info
    from scheduler.protocol import RunnerConfig

    info = read_model_info(models_dir / "tiny.gguf")
    cfg = RunnerConfig(2048, flash_attn=True)  # as runners load (GGUFQ_FLASH_ATTENTION)
    per_block, compute, output = group_parts(info, cfg)
    # each GPU holds a compute buffer, one block, and the output layer: not the whole model
    size = compute + max(per_block) + output + 4096
    assert size < estimate_bytes(info, cfg) and len(per_block) == 2
    env = stack_env(models_dir, tmp_path / "state", host="pair")
    settings = settings_from(env, None)
    worker = ["--virtual-gpu", str(size), "--virtual-gpu", str(size)]
    with LocalStack(settings, worker_args=worker, log_dir=tmp_path / "logs", extra_env=env) as st:
        with Client(st.redis_url, settings=settings, timeout=60) as client:
            result = client.generate("tiny", "hi", options={"num_predict": 4, "num_ctx": 2048})
            assert result.done
            (runner,) = client.ps()
            held = runner.devices
            assert set(held) == {"vgpu:pair:0", "vgpu:pair:1"}
            reserved = {d.id: d.reserved for d in client.devices()}
            assert reserved == held and all(0 < b <= size for b in held.values())
            out = ggufq("ps", env={**env, "GGUFQ_REDIS_URL": st.redis_url})
            assert "vgpu:pair:0,vgpu:pair:1" in out.stdout.replace(" ", "")
            client.unload("tiny")
            assert wait_for(lambda: not client.ps())
            assert all(d.reserved == 0 for d in client.devices())


@needs_demo
def test_demo_command_runs_end_to_end(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GGUFQ_STATE_DIR": str(tmp_path / "state"),
        "GGUFQ_MODELS_DIR": str(tmp_path / "models"),
        "GGUFQ_HOST_ID": "demohost",
    }
    env.pop("GGUFQ_REDIS_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "api_client.cli", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5/5" in out.stdout and "Streaming:" in out.stdout
    assert "gemma3-270m" in out.stdout and "100% CPU" in out.stdout
    assert "100 degrees" in out.stdout  # "Water boils at a temperature of" at temperature 0
    assert out.stdout.rstrip().endswith("Done.")
    assert not (tmp_path / "state" / "stack.json").exists()

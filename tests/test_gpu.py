"""The GPU path on a real NVIDIA GPU (issue 20): NVML discovery, every layer offloaded, the
memory estimate against what CUDA allocates, the wait for freed memory after an unload, a
load that cannot fit, partial offload under a virtual cap, two models on one GPU, flash
attention on and off.

Marked ``gpu``: skipped where no NVIDIA GPU answers or llama-cpp-python was built without
CUDA (CI too: no GPU is expected there). ``bench/gpu/run.sh`` runs them on a GPU with
GGUFQ_REQUIRE_GPU=1, which turns that skip into a failure, so that a GPU run cannot pass by
skipping; GGUFQ_GPU_RESULTS names a folder for the figures measured (JSON lines).

Models: small generated llamas with 64-wide heads (CUDA's flash attention has no kernel for
the 16-wide heads of tests/tinymodel.py's default), and "mid", a random-weight model of
Llama 3.2 1B's shape cut to 4 blocks (bench/gpu/make_model.py, 537 MB of Q8_0), large enough
that CUDA's 2 MiB allocation granularity stays far below the estimate's tolerance.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from api_client import Client, LoadFailed
from scheduler.cluster import DeviceView
from scheduler.gguf.estimate import estimate, estimate_bytes, partial_table
from scheduler.gguf.metadata import read_model_info
from scheduler.local.stack import LocalStack
from scheduler.protocol import Options, RunnerConfig
from tests.conftest import ggufq, settings_from, stack_env, wait_for
from tests.tinymodel import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GREEDY = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
# about 400 tokens of the generated vocabularies (16 a phrase): one prompt batch, within the
# 512-token slot of the smallest configuration measured (2048 over 4 slots)
PROMPT = "the sky is blue " * 25


def _why_not() -> str | None:
    """Why the GPU tests cannot run here; None when an NVIDIA GPU and a CUDA build answer."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU here (nvidia-smi is not on PATH); bench/gpu/run.sh runs these on one"
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML sees no GPU"
    except Exception as exc:
        return f"no NVIDIA GPU here: NVML does not answer ({exc})"
    try:
        from workers.cpus import llama

        if not llama().llama_supports_gpu_offload():
            return (
                "llama-cpp-python was built without CUDA: CMAKE_ARGS='-DGGML_CUDA=on' pip "
                "install --no-binary llama-cpp-python llama-cpp-python (bench/gpu/run.sh does)"
            )
    except Exception as exc:
        return f"llama-cpp-python does not load ({exc})"
    return None


WHY_NOT = _why_not()
REQUIRED = os.environ.get("GGUFQ_REQUIRE_GPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(WHY_NOT is not None and not REQUIRED, reason=WHY_NOT or ""),
]


@pytest.fixture(scope="module", autouse=True)
def _gpu_required() -> None:
    if WHY_NOT is not None:
        pytest.fail(f"GGUFQ_REQUIRE_GPU=1, but {WHY_NOT}")


# -- the GPU as NVML and nvidia-smi see it --------------------------------------------------------
def nvml_free(index: int = 0) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)


def nvml_used(index: int = 0) -> int:
    """Bytes in use on the GPU: total less free (what NVML's "used" means, reserved or not)."""
    import pynvml

    mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
    return int(mem.total) - int(mem.free)


def settled(read: Callable[[], int], timeout_s: float = 5.0) -> int:
    """A reading that held within 1 MiB for 0.2 s: the driver reports frees with a lag."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if abs(now - last) > MIB:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.2:
            return now
    return read()


def nvidia_smi(fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]


def record(name: str, row: dict[str, Any]) -> None:
    """Append a measured row to GGUFQ_GPU_RESULTS/<name>.jsonl (when set), and print it."""
    print(f"{name}: {json.dumps(row)}")
    folder = os.environ.get("GGUFQ_GPU_RESULTS")
    if folder:
        with open(Path(folder) / f"{name}.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


@contextmanager
def hog(leave: int, index: int = 0) -> Iterator[int]:
    """Another process holds all of the GPU's free memory but ``leave`` bytes (CUDA driver
    API, a plain allocation) until the block ends; yields the bytes it took."""
    script = (
        "import ctypes, sys\n"
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "def check(rc, what):\n"
        "    if rc: sys.exit(f'{what}: CUDA error {rc}')\n"
        "check(cuda.cuInit(0), 'cuInit')\n"
        "dev, ctx = ctypes.c_int(), ctypes.c_void_p()\n"
        f"check(cuda.cuDeviceGet(ctypes.byref(dev), {index}), 'cuDeviceGet')\n"
        "check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), 'cuDevicePrimaryCtxRetain')\n"
        "check(cuda.cuCtxSetCurrent(ctx), 'cuCtxSetCurrent')\n"
        "free, total = ctypes.c_size_t(), ctypes.c_size_t()\n"
        "check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), 'cuMemGetInfo')\n"
        "take, ptr = free.value - int(sys.argv[1]), ctypes.c_uint64()\n"
        "check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(take)), 'cuMemAlloc')\n"
        "print(take, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(leave)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the GPU memory hog failed: {proc.communicate()[1]}")
    try:
        yield int(line)
    finally:
        proc.communicate(timeout=30)  # closes its stdin (it lets go) and reads its pipes out


# -- models and stacks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """small and small2 (two 4-block llamas, 64-wide heads, endless), and mid."""
    models = tmp_path_factory.mktemp("gpu-models")
    shape = {"n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "n_layer": 4}
    write_tiny_model(models / "small.gguf", context_length=8192, endless=True, **shape)
    write_tiny_model(models / "small2.gguf", context_length=8192, endless=True, seed=1, **shape)
    subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/make_model.py"), str(models / "mid.gguf")]
        + ["--layers", "4"],
        check=True,
        capture_output=True,
    )
    return models


@dataclass
class GpuStack:
    stack: LocalStack
    client: Client
    env: dict[str, str]
    logs: Path
    gpu: str  # the device id of CUDA device 0

    def device(self, device_id: str | None = None) -> DeviceView:
        wanted = device_id or self.gpu
        return next(d for d in self.client.devices() if d.id == wanted)

    def ps_line(self, model: str) -> str:
        out = ggufq("ps", env={**self.env, "GGUFQ_REDIS_URL": self.stack.redis_url})
        return next(x for x in out.stdout.splitlines() if x.split() and x.split()[0] == model)

    def unload_all(self) -> None:
        for model in {r.model for r in self.client.ps()}:
            self.client.unload(model)
        assert wait_for(lambda: not self.client.ps(), timeout=60)
        assert wait_for(lambda: all(d.reserved == 0 for d in self.client.devices()), timeout=30)


@contextmanager
def gpu_stack(
    models: Path,
    tmp: Path,
    host: str,
    worker_args: list[str] | None = None,
    extra: dict[str, str] | None = None,
) -> Iterator[GpuStack]:
    """A private stack (its own Redis, placement, one worker on this machine's GPUs)."""
    env = {**stack_env(models, tmp / "state", host=host), **(extra or {})}
    settings = settings_from(env, None)
    logs = tmp / "logs"
    args = worker_args or []
    with LocalStack(settings, worker_args=args, log_dir=logs, extra_env=env) as stack:
        with Client(stack.redis_url, settings=settings, timeout=180) as client:
            kind = "vgpu" if args else "gpu"
            yield GpuStack(stack, client, env, logs, f"{kind}:{host}:0")


@pytest.fixture(scope="module")
def shared(gpu_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuStack]:
    """One stack on the real GPU for the tests that leave it as they found it."""
    with gpu_stack(gpu_models, tmp_path_factory.mktemp("gpu-stack"), "gpuhost") as st:
        yield st


# -- discovery and offload -----------------------------------------------------------------------
def test_nvml_discovery_matches_nvidia_smi() -> None:
    from workers.devices import nvidia_gpus

    found = nvidia_gpus("gpuhost", "w")
    rows = nvidia_smi("index,name,uuid,memory.total,memory.free")
    assert len(found) == len(rows) > 0
    for dev, (index, name, uuid, total, free) in zip(found, rows, strict=True):
        assert (dev.id, dev.kind, dev.virtual) == (f"gpu:gpuhost:{index}", "gpu", False)
        assert dev.name == name and dev.uuid == uuid
        assert abs(dev.total / MIB - int(total)) <= 1, (dev.total, total)
        # free moves with whatever else runs on the GPU between the two readings
        assert abs(dev.free / MIB - int(free)) <= max(64, int(total) // 100), (dev.free, free)


def test_a_worker_on_the_gpu_serves_with_every_layer_offloaded(shared: GpuStack) -> None:
    from workers.devices import nvidia_gpus

    device = shared.device()
    nvml = nvidia_gpus("gpuhost", "")[0]
    assert device.kind == "gpu" and not device.virtual
    assert (device.name, device.total, device.uuid) == (nvml.name, nvml.total, nvml.uuid)
    assert device.worker.startswith("ggufq-gpu0")
    before = settled(nvml_used)
    result = shared.client.generate("small", PROMPT, options=GREEDY, keep_alive=-1)
    assert result.done and result.device == shared.gpu and result.eval_count == 8
    (runner,) = [r for r in shared.client.ps() if r.model == "small"]
    assert runner.n_gpu_layers == -1 and runner.devices == {shared.gpu: runner.bytes}
    assert shared.device().reserved == runner.bytes
    assert "100% GPU" in shared.ps_line("small")
    # the GPU holds the runner (and, the worker's first, its CUDA context)
    held = settled(nvml_used) - before
    record("offload", {"runner_bytes": runner.bytes, "nvml_delta": held})
    assert held >= runner.bytes
    shared.unload_all()


def test_two_models_resident_on_one_gpu(shared: GpuStack) -> None:
    first = shared.client.generate("small", "hi", options=GREEDY, keep_alive=-1)
    second = shared.client.generate("small2", "hi", options=GREEDY, keep_alive=-1)
    assert first.device == second.device == shared.gpu
    runners = {r.model: r for r in shared.client.ps()}
    assert set(runners) == {"small", "small2"}
    assert all(r.state == "ready" and r.n_gpu_layers == -1 for r in runners.values())
    assert shared.device().reserved == sum(r.bytes for r in runners.values())
    again = shared.client.generate("small", "again", options=GREEDY)
    assert again.done and again.device == shared.gpu and again.load_duration == 0
    assert len(shared.client.ps()) == 2
    shared.unload_all()


def test_after_an_unload_placement_waits_until_nvml_shows_the_memory_back(
    shared: GpuStack,
) -> None:
    shared.client.generate("mid", "hi", options=GREEDY, keep_alive=-1)
    (runner,) = [r for r in shared.client.ps() if r.model == "mid"]
    loaded_free = settled(nvml_free)
    assert shared.client.unload("mid")
    # the worker releases the reservation (what placement reads) only once the driver
    # shows most of the memory back: when it is gone, NVML has it
    assert wait_for(lambda: shared.device().reserved == 0, timeout=30)
    back = nvml_free() - loaded_free
    record("unload_wait", {"runner_bytes": runner.bytes, "nvml_back": back})
    assert back >= 0.75 * runner.bytes, (back, runner.bytes)
    assert "still shows runner" not in (shared.logs / "worker.log").read_text()
    assert wait_for(lambda: not shared.client.ps())


# -- the estimate against CUDA ---------------------------------------------------------------
_BUFFER = re.compile(r"(\S+)\s+(model|KV|output|compute) buffer size =\s+([\d.]+) MiB")


def gpu_buffers(log: str) -> dict[str, int]:
    """Bytes per kind (model, KV, output, compute) that llama.cpp's log puts on CUDA devices."""
    out: dict[str, int] = {}
    for device, kind, mib in _BUFFER.findall(log):
        if device.startswith("CUDA") and not device.startswith("CUDA_Host"):
            out[kind] = out.get(kind, 0) + round(float(mib) * MIB)
    return out


@contextmanager
def llama_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs (the callback is process-wide)."""
    from llama_cpp import _logger

    from workers.cpus import llama

    L = llama()
    lines: list[str] = []

    @L.llama_log_callback
    def capture(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    L.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@pytest.fixture(scope="module")
def cuda_ready(gpu_models: Path) -> None:
    """This process's CUDA context and cuBLAS made by a first runner, so that the deltas
    measured next are the runner's own; records what that first one cost."""
    from workers.engine.loop import Engine

    before = settled(nvml_used)
    config = RunnerConfig.for_generation(512, 1, True)
    engine = Engine(str(gpu_models / "small.gguf"), config, n_gpu_layers=-1, name="warm")
    engine.generate(PROMPT, Options(**GREEDY), lambda _text: None)
    engine.close()
    record("cuda_context", {"first_runner_left_bytes": settled(nvml_used) - before})


CONFIGS = [
    (num_ctx, parallel, flash, kv)
    for num_ctx in (2048, 8192)
    for parallel in (1, 4)
    for flash, kv in ((False, "f16"), (True, "f16"), (True, "q8_0"))
]


@pytest.mark.parametrize(
    ("num_ctx", "parallel", "flash", "kv"),
    CONFIGS,
    ids=[f"ctx{c}-x{p}-{'fa' if f else 'nofa'}-{k}" for c, p, f, k in CONFIGS],
)
def test_the_estimate_matches_what_cuda_allocates(
    gpu_models: Path, cuda_ready: None, num_ctx: int, parallel: int, flash: bool, kv: str
) -> None:
    """The runner's bytes on the GPU as NVML sees them once it has served a prompt batch:
    the estimate within +5 % / -2 % (under-estimates crash a GPU, over-estimates waste it)."""
    from workers.engine.loop import Engine

    path = gpu_models / "mid.gguf"
    info = read_model_info(path)
    config = replace(RunnerConfig.for_generation(num_ctx, parallel, flash), kv_type=kv)
    parts = estimate(info, config, num_gpu=-1).by_device()["gpu"]
    base = settled(nvml_used)
    with llama_log() as lines:
        engine = Engine(str(path), config, n_gpu_layers=-1, name="mid")
    try:
        loaded = settled(nvml_used) - base
        engine.generate(PROMPT, Options(**GREEDY), lambda _text: None)
        serving = settled(nvml_used) - base
    finally:
        engine.close()
    logged = gpu_buffers("".join(lines))
    error = parts.total / serving - 1
    row = {
        "num_ctx": num_ctx,
        "parallel": parallel,
        "flash_attn": flash,
        "kv_type": kv,
        "estimate": {
            "weights": parts.weights,
            "kv": parts.kv,
            "compute": parts.compute,
            "output": parts.output,
            "total": parts.total,
        },
        "llama_log": logged,
        "nvml_loaded": loaded,
        "nvml_serving": serving,
        "error_vs_serving": error,
        "error_vs_loaded": parts.total / loaded - 1,
    }
    record("estimate_vs_cuda", row)
    assert logged.get("model", 0) > 0 and logged.get("KV", 0) > 0, "nothing on CUDA: " + str(row)
    assert -0.02 <= error <= 0.05, f"estimate {error:+.1%} off what CUDA holds: {row}"


# -- loads that do not fit ---------------------------------------------------------------------
def test_a_load_that_cannot_fit_releases_its_reservation_and_reports(
    gpu_models: Path, tmp_path: Path
) -> None:
    # the worker reports free memory rarely here: placement keeps believing it has room
    slow = {"GGUFQ_HEARTBEAT_INTERVAL_S": "120", "GGUFQ_DEVICE_TTL_S": "600"}
    with gpu_stack(gpu_models, tmp_path, "oomhost", extra=slow) as st:
        # the worker's CUDA context first: made under the hog, it would abort the process
        st.client.generate("small", "hi", options=GREEDY, keep_alive=0)
        assert wait_for(lambda: not st.client.ps() and st.device().reserved == 0)
        info = read_model_info(gpu_models / "mid.gguf")
        need = estimate_bytes(info, RunnerConfig.for_generation(2048, 1, True))
        assert st.device().free > need  # so placement sends the job to the GPU
        with hog(leave=need // 4) as taken:
            with pytest.raises(LoadFailed, match=rf"'mid' could not be loaded on {st.gpu}"):
                st.client.generate("mid", "hi", options={**GREEDY, "num_ctx": 2048})
            assert not [r for r in st.client.ps() if r.model == "mid"]
            assert all(d.reserved == 0 for d in st.client.devices())
        record("load_that_cannot_fit", {"hog_bytes": taken, "needed": need})
        # the memory back, the same job runs: the worker kept serving
        result = st.client.generate("mid", "hi", options={**GREEDY, "num_ctx": 2048})
        assert result.done and result.device == st.gpu


def test_partial_offload_under_a_virtual_cap(gpu_models: Path, tmp_path: Path) -> None:
    """A worker that advertises a virtual GPU smaller than the model: placement offloads
    part of it, and the CUDA build of llama.cpp puts that part on the real GPU (device 0)."""
    info = read_model_info(gpu_models / "mid.gguf")
    config = RunnerConfig.for_generation(2048, 1, True)  # what placement loads for the job
    table = partial_table(info, config)
    layers = len(table) // 2  # the output layer and layers - 1 blocks
    cap = (table[layers - 1] + table[layers]) // 2  # room for that many layers, not one more
    with gpu_stack(gpu_models, tmp_path, "caphost", ["--virtual-gpu", str(cap)]) as st:
        # the worker's CUDA context first (small fits whole): what follows is the runner's
        st.client.generate("small", "hi", options=GREEDY, keep_alive=0)
        assert wait_for(lambda: not st.client.ps() and st.device().reserved == 0)
        base = settled(nvml_used)
        result = st.client.generate("mid", PROMPT, options={**GREEDY, "num_ctx": 2048})
        assert result.done and result.device == st.gpu and result.eval_count == 8
        (runner,) = [r for r in st.client.ps() if r.model == "mid"]
        assert runner.n_gpu_layers == layers and runner.bytes == table[layers - 1]
        assert "CPU/GPU" in st.ps_line("mid")
        on_gpu = settled(nvml_used) - base
        record(
            "partial_offload",
            {"layers": layers, "runner_bytes": runner.bytes, "size": runner.size, "nvml": on_gpu},
        )
        assert 0.9 * runner.bytes <= on_gpu <= 1.05 * runner.bytes + 128 * MIB
        assert on_gpu < 0.8 * runner.size


# -- flash attention ---------------------------------------------------------------------------
def test_flash_attention_on_and_off(gpu_models: Path, tmp_path: Path) -> None:
    info = read_model_info(gpu_models / "small.gguf")
    options = {**GREEDY, "num_ctx": 4096, "num_predict": 64}
    texts = {}
    for flash in (True, False):
        extra = {"GGUFQ_FLASH_ATTENTION": str(int(flash))}
        folder = tmp_path / f"fa{int(flash)}"
        with gpu_stack(gpu_models, folder, f"fa{int(flash)}", extra=extra) as st:
            result = st.client.generate("small", PROMPT, options=options, keep_alive=-1)
            assert result.done and result.device == st.gpu and result.eval_count == 64
            (runner,) = st.client.ps()
            config = RunnerConfig.for_generation(4096, 1, flash)
            assert runner.bytes == estimate_bytes(info, config)
            assert "100% GPU" in st.ps_line("small")
            first = st.client.generate("small", PROMPT, options={**options, "num_predict": 4})
            texts[flash] = first.response
            record(
                "flash_attention",
                {
                    "flash_attn": flash,
                    "runner_bytes": runner.bytes,
                    "tok_s": 64 / ((result.eval_duration or 1) / 1e9),
                },
            )
    # the same greedy tokens either way (4 of them: far from a near-tie of random logits)
    assert texts[True] == texts[False]

"""The memory estimator: pure rules, and agreement with what llama.cpp really allocates."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.errors import InvalidRequest
from scheduler.gguf.estimate import (
    context_sizes,
    estimate,
    kv_caches,
    max_layers_that_fit,
    row_bytes,
)
from scheduler.gguf.metadata import ModelInfo, read_model_info, swa_layers
from scheduler.protocol import RunnerConfig
from scheduler.units import MIB
from tests.tinymodel import calibration_models
from workers.measure import measure_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return calibration_models(tmp_path_factory.mktemp("calibration"))


def test_quantized_rows_at_true_block_sizes() -> None:
    assert row_bytes("f16", 256) == 512
    assert row_bytes("q8_0", 256) == 8 * 34  # Ollama counted 1 byte per value
    assert row_bytes("q4_0", 256) == 8 * 18
    assert row_bytes("f32", 10) == 40


@pytest.mark.parametrize(
    ("num_ctx", "parallel", "expected"),
    [
        (1000, 1, (1024, 1024, 1)),
        (512, 4, (2048, 512, 4)),
        (2000, 3, (6144, 2048, 3)),
        (100, 1, (256, 256, 1)),
        (700, 3, (2304, 768, 3)),
    ],
)
def test_context_padding_and_streams(num_ctx: int, parallel: int, expected: tuple) -> None:
    n_ctx, cells, streams, _ub = context_sizes(RunnerConfig(num_ctx, parallel))
    assert (n_ctx, cells, streams) == expected


def test_swa_patterns() -> None:
    assert swa_layers("gemma3", 12, 512, {}) == tuple(i % 6 != 5 for i in range(12))
    assert swa_layers("gemma2", 4, 4096, {}) == (True, False, True, False)
    assert swa_layers("gemma3", 6, 0, {}) == (False,) * 6  # no window: no SWA
    assert swa_layers("llama", 4, 4096, {}) == (False,) * 4  # unknown: full caches, safe
    explicit = {"x.attention.sliding_window_pattern": [True, False, False]}
    assert swa_layers("x", 3, 128, explicit) == (True, False, False)


def test_swa_cache_sized_to_window_unless_full(tiny: dict[str, Path]) -> None:
    info = read_model_info(tiny["tiny-gemma3-swa"])
    base, swa = kv_caches(info, RunnerConfig(4096))
    assert (base.swa, base.cells, len(base.layers)) == (False, 4096, 1)
    assert (swa.swa, swa.cells, len(swa.layers)) == (True, 768, 5)  # pad(64 + 512)
    full = kv_caches(info, RunnerConfig(4096, swa_full=True))
    assert [c.cells for c in full] == [4096, 4096]


def test_partial_offload_follows_llama_cpp(tiny: dict[str, Path]) -> None:
    info = read_model_info(tiny["tiny-llama-wide"])
    cfg = RunnerConfig(2048)
    none, one, all_ = (estimate(info, cfg, num_gpu=n) for n in (0, 1, -1))
    assert [d.device for d in none.devices] == ["host"]
    gpu, host = one.devices
    assert gpu.layers == 0 and gpu.weights == info.output_bytes and gpu.kv == 0  # output first
    gpu, host = all_.devices
    assert gpu.layers == info.block_count and host.weights == info.input_bytes
    assert gpu.kv == sum(c.bytes for c in all_.kv_caches) and host.kv == 0
    fit = max_layers_that_fit(info, cfg, free_gpu=gpu.total - 1)
    assert 1 <= fit <= info.block_count
    assert max_layers_that_fit(info, cfg, free_gpu=gpu.total) == info.block_count + 1
    assert max_layers_that_fit(info, cfg, free_gpu=1024) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_type": "q8_0"}, "needs flash attention"),
        ({"kv_type": "q3"}, "not a KV cache type"),
        ({"num_ctx": 10**12}, "out of range"),
        ({"num_parallel": 0}, "out of range"),
    ],
)
def test_bad_configs_are_refused(tiny: dict[str, Path], change: dict, message: str) -> None:
    info = read_model_info(tiny["tiny-llama-gqa"])
    with pytest.raises(InvalidRequest, match=message):
        estimate(info, replace(RunnerConfig(2048), **change))


def test_quantized_kv_needs_heads_divisible_by_block(models_dir: Path) -> None:
    info = read_model_info(models_dir / "tiny.gguf")  # 16-wide heads
    with pytest.raises(InvalidRequest, match="divisible by 32"):
        estimate(info, RunnerConfig(2048, kv_type="q8_0", flash_attn=True))


GRID = [
    (ctx, par, fa, kv)
    for ctx, par, fa, kv in itertools.product(
        [512, 2048, 8192], [1, 4], [False, True], ["f16", "q8_0"]
    )
    if fa or kv == "f16"
]


@pytest.mark.parametrize("model", ["tiny-llama-gqa", "tiny-qwen2", "tiny-gemma3-swa"])
def test_estimate_agrees_with_llama_cpp(tiny: dict[str, Path], model: str) -> None:
    info: ModelInfo = read_model_info(tiny[model])
    for num_ctx, par, fa, kv in GRID:
        cfg = RunnerConfig(num_ctx, par, kv_type=kv, flash_attn=fa)
        m = measure_config(str(tiny[model]), cfg)
        est = estimate(info, cfg).by_device()["host"]
        case = f"{model} num_ctx={num_ctx} parallel={par} fa={fa} kv={kv}"
        assert abs(est.kv - m.kv) <= 0.1 * MIB, case
        assert [c.cells for c in estimate(info, cfg).kv_caches] == [k.cells for k in m.kv_caches], (
            case
        )
        assert abs(est.weights / m.weights - 1) <= 0.01, case
        measured_total = m.weights + m.kv + m.compute + m.output
        assert -0.02 <= est.total / measured_total - 1 <= 0.05, case

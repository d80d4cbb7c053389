"""Compute-buffer calibration per architecture, fitted to llama.cpp's own measurements. Pure.

llama.cpp reserves its compute buffer from a worst-case graph; ``estimate.compute_model_bytes``
models the tensors that dominate it (logits, masks, attention scores, feed-forward
activations), which on a dense llama is within 1 % of llama.cpp. Other architectures keep
more tensors alive, so each (architecture, flash attention) pair gets a scale and a fixed
part, fitted by ``bench/estimate_check.py --fit`` from measurements at several context sizes
and raised until no measurement is under-estimated. Architectures without a row get the
largest scale of any row plus 25 % and the largest fixed part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeConstants:
    scale: float
    fixed: int  # bytes


# (architecture, flash attention) -> constants; printed by bench/estimate_check.py --fit
# (llama-cpp-python 0.3.36, CPU; tiny generated llama/qwen2/gemma3 models and Gemma 3 270M)
CALIBRATED: dict[tuple[str, bool], ComputeConstants] = {
    ("gemma3", False): ComputeConstants(scale=0.999, fixed=542901),
    ("gemma3", True): ComputeConstants(scale=0.9975, fixed=48759),
    ("llama", False): ComputeConstants(scale=0.9992, fixed=78644),
    ("llama", True): ComputeConstants(scale=1.0, fixed=14365),
    ("qwen2", False): ComputeConstants(scale=1.0, fixed=10276),
    ("qwen2", True): ComputeConstants(scale=1.0, fixed=14365),
}


def compute_constants(arch: str, flash_attn: bool) -> ComputeConstants:
    known = CALIBRATED.get((arch, flash_attn))
    if known is not None:
        return known
    return fallback(flash_attn)


def fallback(flash_attn: bool) -> ComputeConstants:
    rows = [c for (_a, fa), c in CALIBRATED.items() if fa == flash_attn]
    if not rows:
        return ComputeConstants(scale=1.5, fixed=16 << 20)
    return ComputeConstants(
        scale=round(1.25 * max(r.scale for r in rows), 4), fixed=max(r.fixed for r in rows)
    )


# What CUDA holds beyond llama.cpp's own buffers once a runner's first batch has run (ggml's
# CUDA memory pool and cuBLAS's workspace), by flash attention: NVML's used memory after a
# 400-token prompt less what it showed once loaded, on an H100 (2026-11-26,
# bench/gpu/measured/2026-11-26-be8b289-estimate_vs_cuda.jsonl, 12 configurations of a
# 1B-wide model): exactly 10 MiB with flash
# attention in all of them, 108-110 MiB without, whatever the context and slots.
CUDA_FIRST_BATCH: dict[bool, int] = {True: 10 << 20, False: 110 << 20}

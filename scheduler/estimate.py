"""Memory a runner needs, from GGUF metadata alone. Pure.

A first, deliberately conservative estimate: weights at file size, an f16 KV cache of
``num_ctx × num_parallel`` cells on every layer, and a compute/output buffer sized from the
vocabulary and batch. The estimator issue replaces this with per-component figures that
match llama.cpp's own allocations.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from scheduler.ggufmeta import ModelInfo

MIB = 1 << 20
GIB = 1 << 30
_F16 = 2
_N_BATCH = 512
_FIXED_OVERHEAD = 32 * MIB


@dataclass(frozen=True)
class RunnerConfig:
    """What a runner is loaded with; a job can share a runner only if these match."""

    num_ctx: int
    num_parallel: int
    kv_type: str = "f16"

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]


def choose_num_ctx(requested: int | None, default: int, trained: int) -> tuple[int, str | None]:
    """Context per slot as Ollama chooses it, with a warning when the request was changed."""
    if requested is None:
        return max(4, min(default, trained)), None
    if requested > trained:
        warning = (
            f"num_ctx {requested} is above the model's trained context {trained}; using {trained}"
        )
        return trained, warning
    return max(4, requested), None


def kv_cache_bytes(info: ModelInfo, config: RunnerConfig) -> int:
    cells = config.num_ctx * config.num_parallel
    per_cell = info.head_count_kv * (info.key_length + info.value_length) * _F16
    return info.block_count * cells * per_cell


def compute_bytes(info: ModelInfo, config: RunnerConfig) -> int:
    batch = min(_N_BATCH, config.num_ctx)
    logits = info.vocab_size * batch * 4
    activations = info.embedding_length * batch * 4 * 8
    return logits + activations + _FIXED_OVERHEAD


def estimate_bytes(info: ModelInfo, config: RunnerConfig) -> int:
    """Total bytes the runner will hold on its device."""
    return info.file_size + kv_cache_bytes(info, config) + compute_bytes(info, config)


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"

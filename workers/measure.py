"""What llama.cpp really allocates for a model and context, read from its own log lines.

Loads the model with the low-level API (so that every context parameter the estimator
models can be set), captures llama.cpp's log through a log callback, and parses the buffer
sizes it reports. Used by the estimator's validation harness and tests; CPU only.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from scheduler.protocol import RunnerConfig
from workers.cpus import llama
from workers.engine.load import GGML_KV_TYPES

MIB = 1 << 20

_MODEL = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
_KV_SIZE = re.compile(
    r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\)"
)
_OUTPUT = re.compile(r"(\S+)\s+output buffer size =\s+([\d.]+) MiB")
_COMPUTE_EXACT = re.compile(r"~llama_context:\s+(\S+) compute buffer size is\s+([\d.]+) MiB")
_COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_lock = threading.Lock()


@dataclass
class KVCacheLog:
    cells: int
    layers: int
    seqs: int
    mib: float


@dataclass
class Measured:
    """Bytes per component as llama.cpp reported them (MiB with 2-4 decimals)."""

    model_buffers: dict[str, int] = field(default_factory=dict)  # CPU_Mapped, CPU_REPACK, ...
    kv: int = 0
    kv_caches: list[KVCacheLog] = field(default_factory=list)
    output: int = 0
    compute: int = 0
    log: str = ""

    @property
    def weights(self) -> int:
        """Bytes of the model's tensors (the mapped or loaded buffers, not repacked copies)."""
        return sum(v for k, v in self.model_buffers.items() if "REPACK" not in k)


def measure(
    path: str,
    *,
    n_ctx: int,
    n_seq_max: int = 1,
    n_batch: int = 512,
    n_ubatch: int = 512,
    flash_attn: bool = False,
    kv_type: str = "f16",
    swa_full: bool = False,
    kv_unified: bool = False,
    n_outputs_max: int = 0,
) -> Measured:
    llama_cpp = llama()
    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def capture(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    ggml_type = GGML_KV_TYPES[kv_type]
    with _lock:  # the log callback is process-wide
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        model: Any = None
        ctx: Any = None
        try:
            mparams = llama_cpp.llama_model_default_params()
            mparams.n_gpu_layers = 0
            model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
            if not model:
                raise RuntimeError(f"llama.cpp could not load {path}")
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = n_batch
            cparams.n_ubatch = n_ubatch
            cparams.n_seq_max = n_seq_max
            cparams.n_outputs_max = n_outputs_max
            cparams.flash_attn_type = (
                llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                if flash_attn
                else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
            cparams.type_k = ggml_type
            cparams.type_v = ggml_type
            cparams.swa_full = swa_full
            cparams.kv_unified = kv_unified
            ctx = llama_cpp.llama_init_from_model(model, cparams)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {path}")
        finally:
            if ctx:
                llama_cpp.llama_free(ctx)
            if model:
                llama_cpp.llama_model_free(model)
            from llama_cpp import _logger

            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    return parse_log("".join(lines))


def measure_config(path: str, cfg: RunnerConfig) -> Measured:
    """What llama.cpp allocates for the context a runner with ``cfg`` creates."""
    return measure(
        path,
        n_ctx=cfg.num_ctx * cfg.num_parallel,
        n_seq_max=cfg.num_parallel,
        flash_attn=cfg.flash_attn,
        kv_type=cfg.kv_type,
        swa_full=cfg.swa_full,
        n_batch=cfg.n_batch,
        n_ubatch=cfg.n_ubatch,
        n_outputs_max=cfg.n_outputs,
    )


def parse_log(text: str) -> Measured:
    m = Measured(log=text)
    for name, mib in _MODEL.findall(text):
        m.model_buffers[name] = m.model_buffers.get(name, 0) + _bytes(mib)
    m.kv = sum(_bytes(mib) for _name, mib in _KV.findall(text))
    m.kv_caches = [
        KVCacheLog(int(cells), int(layers), int(seqs), float(mib))
        for mib, cells, layers, seqs, _total in _KV_SIZE.findall(text)
    ]
    m.output = sum(_bytes(mib) for _name, mib in _OUTPUT.findall(text))
    exact = _COMPUTE_EXACT.findall(text)
    m.compute = sum(_bytes(mib) for _n, mib in (exact or _COMPUTE.findall(text)))
    return m


def _bytes(mib: str) -> int:
    return round(float(mib) * MIB)

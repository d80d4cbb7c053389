"""Loading: the llama.cpp backend, and a model with its context, sized as estimated.

:class:`ContextSize` is the context a runner's configuration asks for (as the estimator
sizes it); :func:`_load` loads the model, over several GPUs when placement split it, and
creates that context with the KV cache type named in :data:`GGML_KV_TYPES`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

from scheduler.errors import LoadFailed
from scheduler.protocol import RunnerConfig
from workers.cpus import default_thread_counts
from workers.loadwatch import LoadWatch

# ggml type ids of the KV cache types (ggml.h: GGML_TYPE_F32 = 0, F16 = 1, Q4_0 = 2, ...)
GGML_KV_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}

# llama_decode's return codes (llama.h)
DECODE_ERRORS = {
    1: "no room in the KV cache for the batch",
    2: "decoding was aborted",
    -1: "the batch was invalid",
}


@dataclass(frozen=True)
class ContextSize:
    """The llama.cpp context a runner's configuration asks for (as the estimator sizes it)."""

    n_ctx: int
    n_seq_max: int
    n_batch: int
    n_ubatch: int
    n_outputs_max: int

    @classmethod
    def of(cls, config: RunnerConfig) -> ContextSize:
        n_ctx = config.num_ctx * config.num_parallel
        n_batch = min(config.n_batch, n_ctx)  # as llama-cpp-python clamps, and the estimate
        # a step asks for at most one row of logits per sequence: fewer rows would fail it
        outputs = max(config.n_outputs, config.num_parallel) if config.n_outputs else 0
        return cls(n_ctx, config.num_parallel, n_batch, min(config.n_ubatch, n_batch), outputs)


_backend_ready = threading.Lock()
_backend_done = False


def _init_backend(L: Any) -> None:
    global _backend_done
    with _backend_ready:
        if not _backend_done:
            # as Llama(verbose=False): llama.cpp's info lines are noise in a worker's log
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
            L.llama_backend_init()
            _backend_done = True


def _load(
    L: Any,
    path: str,
    config: RunnerConfig,
    size: ContextSize,
    n_gpu_layers: int,
    n_threads: int | None,
    watch: LoadWatch,
    split: list[float] | None = None,
) -> tuple[Any, Any]:
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    shares = None
    if split:  # layers over several GPUs, as placement split them (workers.devices)
        shares = (ctypes.c_float * L.llama_max_devices())(*split)
        mparams.tensor_split = shares
        mparams.main_gpu = next(i for i, share in enumerate(split) if share > 0)
    on_progress = L.llama_progress_callback(lambda fraction, _data: watch.progress(fraction))
    mparams.progress_callback = on_progress  # kept referenced until the load returns
    model = L.llama_model_load_from_file(path.encode(), mparams)
    del shares  # llama.cpp copied the split while loading
    if not model:
        if watch.stalled_s:
            raise LoadFailed(f"gave up loading {path}: {watch.describe()}")
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = size.n_ctx
    cparams.n_seq_max = size.n_seq_max
    cparams.n_batch = size.n_batch
    cparams.n_ubatch = size.n_ubatch
    cparams.n_outputs_max = size.n_outputs_max
    cparams.kv_unified = False  # one KV stream per sequence, as the estimate assumes
    cparams.flash_attn_type = (
        L.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    cparams.swa_full = config.swa_full
    cparams.type_k = cparams.type_v = GGML_KV_TYPES[config.kv_type]
    one_token, batch = default_thread_counts()  # a thread per physical core, per CPU
    cparams.n_threads = n_threads or one_token
    cparams.n_threads_batch = n_threads or batch
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError(
            f"llama.cpp could not create a context of {size.n_ctx} tokens for {path}"
        )
    return model, ctx

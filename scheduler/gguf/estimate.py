"""Memory a runner needs, per component and per device, from GGUF metadata alone. Pure.

It follows what llama.cpp allocates when it creates a model and a context with
``n_ctx = num_ctx × num_parallel`` and ``n_seq_max = num_parallel`` (one KV stream per
sequence, as llama.cpp does when the cache is not unified):

* weights: the bytes of the tensors each device holds (blocks; the token embedding stays on
  the host; the output projection goes to the GPU only when every block does);
* KV cache: per layer ``cells × streams × (row(K) + row(V))`` with cells padded to 256,
  sliding-window layers sized to ``window + n_ubatch`` (padded) unless the full-size SWA cache
  is on, quantized types at their real block sizes (q8_0 34 bytes per 32 values);
* output buffer: one row of logits per sequence;
* compute buffer: the worst-case graph llama.cpp reserves, from a model whose per-token
  constants are calibrated per architecture against llama.cpp's measurements
  (``scheduler/gguf/calibration.py``), with a conservative fallback for other architectures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.errors import InvalidRequest
from scheduler.gguf.calibration import CUDA_FIRST_BATCH, compute_constants
from scheduler.gguf.metadata import ModelInfo
from scheduler.protocol import RunnerConfig

KV_PAD = 256  # llama.cpp pads the context (and so the KV cache) to 256 cells

# ggml block size and bytes per block of the KV cache types llama.cpp accepts
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}


@dataclass(frozen=True)
class KVCache:
    """One KV cache as llama.cpp creates it (models with sliding windows have two)."""

    swa: bool
    cells: int  # per stream
    streams: int
    layers: tuple[int, ...]
    bytes: int


@dataclass
class DeviceEstimate:
    device: str
    layers: int = 0
    weights: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.output


@dataclass
class Estimate:
    """Bytes per device; ``host`` is the CPU side (weights not offloaded, input layer...)."""

    devices: list[DeviceEstimate]
    kv_caches: list[KVCache] = field(default_factory=list)
    n_gpu_layers: int = 0

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    def by_device(self) -> dict[str, DeviceEstimate]:
        return {d.device: d for d in self.devices}


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


def pad(value: int, to: int = KV_PAD) -> int:
    return -(-value // to) * to


def row_bytes(kv_type: str, n: int) -> int:
    block, size = KV_TYPES[kv_type]
    return -(-n // block) * size


def context_sizes(cfg: RunnerConfig) -> tuple[int, int, int, int]:
    """(n_ctx, cells per stream, streams, n_ubatch) of the llama.cpp context.

    llama.cpp pads the context to 256, gives each sequence its own stream of
    ``pad(n_ctx / n_seq_max)`` cells, and clamps the batches to the context.
    """
    requested = cfg.num_ctx * cfg.num_parallel
    streams = cfg.num_parallel
    cells = pad(pad(requested) // streams)
    n_batch = min(cfg.n_batch, requested)  # llama-cpp-python clamps to the unpadded size
    n_ubatch = min(cfg.n_ubatch, n_batch)
    return cells * streams, cells, streams, n_ubatch


def kv_caches(info: ModelInfo, cfg: RunnerConfig) -> list[KVCache]:
    _n_ctx, cells, streams, n_ubatch = context_sizes(cfg)
    swa_cells = cells if cfg.swa_full else min(cells, pad(info.sliding_window + n_ubatch))
    groups: dict[bool, list[int]] = {False: [], True: []}
    for il, heads_kv in enumerate(_kv_heads(info)):
        if heads_kv > 0:
            groups[_is_swa(info, il)].append(il)
    caches = []
    for swa, layers in groups.items():
        if not layers:
            continue
        n_cells = swa_cells if swa else cells
        per_cell = sum(_kv_row_bytes(info, cfg, il) for il in layers)
        caches.append(KVCache(swa, n_cells, streams, tuple(layers), n_cells * streams * per_cell))
    return caches


def _kv_heads(info: ModelInfo) -> tuple[int, ...]:
    return info.head_count_kv_layers or (info.head_count_kv,) * info.block_count


def _is_swa(info: ModelInfo, il: int) -> bool:
    return bool(info.swa_layers) and info.swa_layers[il] and info.sliding_window > 0


def _kv_row_bytes(info: ModelInfo, cfg: RunnerConfig, il: int) -> int:
    heads = _kv_heads(info)[il]
    return row_bytes(cfg.kv_type, info.key_length * heads) + row_bytes(
        cfg.kv_type, info.value_length * heads
    )


def kv_cache_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    return sum(c.bytes for c in kv_caches(info, cfg))


def output_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    """Logits of one output per sequence, f32 (llama.cpp's output buffer at creation)."""
    # an embedding context holds one output row per sequence, up to llama.cpp's 256
    n_seq = min(cfg.n_batch, 256) if cfg.embedding else cfg.num_parallel
    return info.vocab_size * 4 * n_seq


def compute_model_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    """The worst-case graph llama.cpp reserves, before per-architecture calibration.

    The reserve runs ``n_ubatch`` tokens against full caches with one logits row per token
    (up to n_outputs). The allocator reuses memory between layers, so the peak is the larger
    of the output phase (logits) and a layer's phase: its masks plus the larger of attention
    (scores of every query head against the largest cache, without flash attention) and the
    feed-forward block.
    """
    _n_ctx, _cells, _streams, t = context_sizes(cfg)
    e, h, f = info.embedding_length, info.head_count, info.feed_forward_length
    cells = [c.cells for c in kv_caches(info, cfg)] or [0]
    n_outputs = min(t, cfg.n_outputs or cfg.n_batch)
    mask = sum(cells) * t * (2 if cfg.flash_attn else 4)
    attention = (0 if cfg.flash_attn else max(cells) * t * h * 4) + (
        5 if cfg.flash_attn else 6
    ) * e * t * 4
    ffn = (4 * f + e) * t * 4
    logits = info.vocab_size * n_outputs * 4 + 3 * e * t * 4
    return max(logits, mask + max(attention, ffn))


EMBEDDING_MARGIN = 1.05  # embedding graphs are not calibrated: Gemma 3 measured 1.6% over


def compute_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    c = compute_constants(info.architecture, cfg.flash_attn)
    scale = c.scale * (EMBEDDING_MARGIN if cfg.embedding else 1.0)
    return int(compute_model_bytes(info, cfg) * scale) + c.fixed


def first_batch_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    """What a GPU holds for a runner beyond llama.cpp's buffers once its first batch ran
    (:data:`CUDA_FIRST_BATCH`); with a quantized KV cache over several sequences, also one
    sequence's K and V of one layer in f16 (the flash-attention path converts them: fitted
    to the one such configuration measured, 8192 x 4 q8_0, 12.6 MB over llama.cpp's
    reserve). Each GPU a runner spans holds it."""
    extra = 0
    if KV_TYPES[cfg.kv_type][0] > 1 and cfg.num_parallel > 1:  # quantized: blocks of 32
        _n_ctx, cells, _streams, _t = context_sizes(cfg)
        extra = cells * (info.key_length + info.value_length) * max(_kv_heads(info)) * 2
    return CUDA_FIRST_BATCH[cfg.flash_attn] + extra


def layers_on_gpu(info: ModelInfo, num_gpu: int) -> int:
    """llama.cpp's n_gpu_layers, clamped: -1 = every block and the output layer."""
    whole = info.block_count + 1
    return whole if num_gpu < 0 else min(num_gpu, whole)


def estimate(info: ModelInfo, cfg: RunnerConfig, num_gpu: int = 0, gpu: str = "gpu") -> Estimate:
    """Bytes on the GPU (when ``num_gpu`` != 0) and on the host.

    ``num_gpu`` is llama.cpp's n_gpu_layers, counting the output layer as one more layer:
    llama.cpp offloads the output layer first, then the last blocks; the token embedding
    always stays on the host (a tied output projection is copied to the GPU). Each block's
    KV cache lives with the block.
    """
    check_config(info, cfg)
    n_gpu = layers_on_gpu(info, num_gpu)
    host, dev = DeviceEstimate("host"), DeviceEstimate(gpu)
    blocks_on_gpu = max(0, n_gpu - 1)
    first_gpu = info.block_count - blocks_on_gpu
    host.weights = info.input_bytes
    for il, nbytes in enumerate(info.layer_bytes):
        (dev if il >= first_gpu else host).weights += nbytes
    output = info.output_bytes + (_tied_projection_bytes(info) if n_gpu and info.tied_output else 0)
    (dev if n_gpu else host).weights += output
    dev.layers, host.layers = blocks_on_gpu, info.block_count - blocks_on_gpu
    caches = kv_caches(info, cfg)
    for cache in caches:
        per_layer = cache.bytes // max(1, len(cache.layers))
        for il in cache.layers:
            (dev if il >= first_gpu else host).kv += per_layer
    host.output = output_bytes(info, cfg)
    if n_gpu:
        dev.compute = compute_bytes(info, cfg) + first_batch_bytes(info, cfg)
        host.compute = _host_compute_when_offloaded(info, cfg)
        return Estimate(devices=[dev, host], kv_caches=caches, n_gpu_layers=n_gpu)
    host.compute = compute_bytes(info, cfg)
    return Estimate(devices=[host], kv_caches=caches, n_gpu_layers=0)


def _tied_projection_bytes(info: ModelInfo) -> int:
    """A tied output shares the token embedding; on a GPU it is a copy of it."""
    return info.input_bytes


def check_config(info: ModelInfo, cfg: RunnerConfig) -> None:
    """Refuse configurations llama.cpp would refuse, with the reason and the fix."""
    if cfg.kv_type not in KV_TYPES:
        raise InvalidRequest(
            f"kv_type {cfg.kv_type!r} is not a KV cache type; use one of {', '.join(KV_TYPES)}"
        )
    if not 4 <= cfg.num_ctx <= 1 << 24 or not 1 <= cfg.num_parallel <= 256:
        raise InvalidRequest(
            f"num_ctx {cfg.num_ctx} × num_parallel {cfg.num_parallel} is out of range "
            "(num_ctx 4..16777216, num_parallel 1..256)"
        )
    block = KV_TYPES[cfg.kv_type][0]
    if block > 1 and not cfg.flash_attn:
        raise InvalidRequest(
            f"a {cfg.kv_type} KV cache needs flash attention (llama.cpp refuses a quantized V "
            "cache without it); turn flash attention on (GGUFQ_FLASH_ATTENTION, or "
            "--flash-attn) or use kv_type f16"
        )
    if block > 1 and (info.key_length % block or info.value_length % block):
        raise InvalidRequest(
            f"a {cfg.kv_type} KV cache needs head sizes divisible by {block}; this model's are "
            f"{info.key_length}/{info.value_length}: use kv_type f16"
        )


def _host_compute_when_offloaded(info: ModelInfo, cfg: RunnerConfig) -> int:
    """With layers on a GPU the host still runs the input embedding lookup."""
    _n_ctx, _cells, _streams, n_ubatch = context_sizes(cfg)
    return n_ubatch * info.embedding_length * 4


def estimate_bytes(info: ModelInfo, cfg: RunnerConfig) -> int:
    """Total bytes placement reserves for a runner with everything on one device: the
    estimate, and what a GPU holds once the first batch ran (:func:`first_batch_bytes`;
    on the CPU, a margin of that size)."""
    return estimate(info, cfg).total + first_batch_bytes(info, cfg)


def gpu_bytes_by_layers(info: ModelInfo, cfg: RunnerConfig) -> tuple[int, ...]:
    """GPU bytes for n_gpu_layers = 1 .. block_count + 1 (increasing)."""
    return tuple(
        estimate(info, cfg, num_gpu=n).devices[0].total for n in range(1, info.block_count + 2)
    )


def max_layers_that_fit(info: ModelInfo, cfg: RunnerConfig, free_gpu: int) -> int:
    """The largest n_gpu_layers whose GPU share fits in ``free_gpu`` (0: nothing fits;
    block_count + 1: the whole model)."""
    return sum(1 for need in gpu_bytes_by_layers(info, cfg) if need <= free_gpu)


def group_parts(info: ModelInfo, cfg: RunnerConfig) -> tuple[tuple[int, ...], int, int]:
    """For a model split over several GPUs: (weights + KV of each block, the compute buffer
    and first batch's workspace every GPU holds, the output layer that goes with the last
    block)."""
    per_block = list(info.layer_bytes)
    for cache in kv_caches(info, cfg):
        per_layer = cache.bytes // max(1, len(cache.layers))
        for il in cache.layers:
            per_block[il] += per_layer
    output = info.output_bytes + (_tied_projection_bytes(info) if info.tied_output else 0)
    return tuple(per_block), compute_bytes(info, cfg) + first_batch_bytes(info, cfg), output


def partial_table(info: ModelInfo, cfg: RunnerConfig) -> tuple[int, ...]:
    """GPU bytes for n_gpu_layers = 1 .. block_count: the partial offloads (branch 6)."""
    return gpu_bytes_by_layers(info, cfg)[:-1]

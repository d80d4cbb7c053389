"""What a GGUF file says about its model: architecture, sizes, context, quantization.

Never loads the model in llama.cpp. Parsed once per (path, size, mtime). Every failure is an
InvalidModelFile that names the file and the problem, never an exception from the reader.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, LlamaFileType

from scheduler.errors import InvalidModelFile, shown
from scheduler.gguf.parse import (
    GGUFFormatError,
    GGUFHeader,
    SkippedArray,
    parse_header,
    string_item,
)

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    path: str
    file_size: int
    architecture: str
    parameter_count: int
    quantization: str
    context_length: int
    block_count: int
    embedding_length: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    vocab_size: int
    sliding_window: int
    has_chat_template: bool
    feed_forward_length: int = 0
    head_count_kv_layers: tuple[int, ...] = ()  # per layer; 0 = the layer keeps no KV
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    layer_bytes: tuple[int, ...] = ()  # weights of each block (blk.N.*)
    input_bytes: int = 0  # token embedding and other tensors outside the blocks
    output_bytes: int = 0  # output projection and norm (0 projection when tied)
    tied_output: bool = False
    pooling_type: int = -1  # llama.cpp's enum: -1 unspecified, 0 none, 1 mean, 2 cls, 3 last
    chat_template: str = ""
    bos_text: str = ""  # the BOS and EOS tokens as text, for chat templates
    eos_text: str = ""


_cache: dict[tuple[str, int, int], ModelInfo] = {}
_cache_lock = threading.Lock()


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Metadata of a GGUF file, cached by (path, size, mtime)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise InvalidModelFile(f"cannot read model file {path}: {exc.strerror}") from None
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    try:
        info = _parse(path, stat.st_size)
    except InvalidModelFile:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, OSError) as exc:
        # a header that parses but holds what no model holds (a string where a number
        # belongs, say): a typed error naming the file, never an exception out of placement
        raise InvalidModelFile(
            f"{path} has GGUF metadata this version cannot use ({exc}); "
            "export the model again, or remove the file from the models directory"
        ) from None
    with _cache_lock:
        _cache[key] = info
    return info


def _parse(path: Path, file_size: int) -> ModelInfo:
    with path.open("rb") as fh:
        head = fh.read(4)
        if head != GGUF_MAGIC:
            raise InvalidModelFile(
                f"{path} is not a GGUF file (it starts with {head!r}, GGUF files start with "
                "b'GGUF'); convert it with llama.cpp's convert_hf_to_gguf.py or remove it from "
                "the models directory"
            )
        if file_size < 24:
            raise InvalidModelFile(f"{path} is truncated ({file_size} bytes): copy it again")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                header = parse_header(mm)
                tokens = header.fields.get("tokenizer.ggml.tokens")
                specials = [
                    string_item(mm, tokens, int(header.fields.get(f"tokenizer.ggml.{name}", -1)))
                    for name in ("bos_token_id", "eos_token_id")
                ]
            except GGUFFormatError as exc:
                raise InvalidModelFile(
                    f"{path} is not a readable GGUF file ({exc}); it is truncated or corrupt: "
                    "copy or export it again"
                ) from None
    fields = header.fields

    def get(name: str, default: Any = None) -> Any:
        value = fields.get(name, default)
        if isinstance(value, list):  # per-layer arrays: the largest value sizes memory safely
            return max(value) if value else default
        return value

    def number(name: str, default: int) -> int:
        """A numeric key (the largest of a per-layer array); another type is refused,
        naming the key, instead of failing somewhere inside int()."""
        value = get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidModelFile(
                f"{path} has {name} = {shown(value)} ({type(value).__name__}) where a number "
                "belongs; export the model again, or remove the file from the models directory"
            )
        return int(value)

    arch = get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModelFile(
            f"{path} has no general.architecture key; it is not a model GGUF (maybe an adapter "
            "or projector file): remove it from the models directory"
        )
    data_end = header.data_offset + max((t.offset + t.n_bytes for t in header.tensors), default=0)
    if data_end > file_size or not header.tensors:
        raise InvalidModelFile(
            f"{path} is truncated: its tensors need {data_end} bytes, the file has {file_size}; "
            "copy or export it again"
        )
    block_count = _positive(path, f"{arch}.block_count", get(f"{arch}.block_count"))
    embedding = _positive(path, f"{arch}.embedding_length", get(f"{arch}.embedding_length"))
    heads = number(f"{arch}.attention.head_count", 1) or 1
    heads_kv = number(f"{arch}.attention.head_count_kv", heads) or heads
    head_dim = embedding // max(heads, 1)
    tokens = fields.get("tokenizer.ggml.tokens")
    n_tokens = tokens.length if isinstance(tokens, SkippedArray) else len(tokens or [])
    layer_bytes, input_bytes, output_bytes, tied = _tensor_groups(header, block_count)
    kv_layers = _per_layer(fields.get(f"{arch}.attention.head_count_kv", heads), block_count)
    sliding_window = number(f"{arch}.attention.sliding_window", 0)
    return ModelInfo(
        path=str(path),
        file_size=file_size,
        architecture=arch,
        parameter_count=sum(t.n_elements for t in header.tensors),
        quantization=_quantization(get("general.file_type"), header),
        context_length=_positive(path, f"{arch}.context_length", get(f"{arch}.context_length")),
        block_count=block_count,
        embedding_length=embedding,
        head_count=heads,
        head_count_kv=heads_kv,
        key_length=number(f"{arch}.attention.key_length", head_dim) or head_dim,
        value_length=number(f"{arch}.attention.value_length", head_dim) or head_dim,
        vocab_size=number(f"{arch}.vocab_size", 0) or n_tokens,
        sliding_window=sliding_window,
        has_chat_template="tokenizer.chat_template" in fields,
        feed_forward_length=number(f"{arch}.feed_forward_length", 0),
        head_count_kv_layers=kv_layers,
        swa_layers=swa_layers(arch, block_count, sliding_window, fields),
        layer_bytes=layer_bytes,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        tied_output=tied,
        pooling_type=number(f"{arch}.pooling_type", -1),
        chat_template=str(fields.get("tokenizer.chat_template", "")),
        bos_text=specials[0],
        eos_text=specials[1],
    )


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value[:n_layer]) + (0,) * max(0, n_layer - len(value))
    return (int(value or 0),) * n_layer


def _tensor_groups(header: GGUFHeader, n_layer: int) -> tuple[tuple[int, ...], int, int, bool]:
    """Weights per block, of the input side and of the output side, as llama.cpp places them."""
    layers = [0] * n_layer
    input_bytes = output_bytes = 0
    names = {t.name for t in header.tensors}
    for tensor in header.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < n_layer:
            layers[int(parts[1])] += tensor.n_bytes
        elif parts[0] in ("output", "output_norm"):
            output_bytes += tensor.n_bytes
        else:
            input_bytes += tensor.n_bytes
    return tuple(layers), input_bytes, output_bytes, "output.weight" not in names


# Layers with sliding-window attention when the file has no per-layer pattern: one in every
# N layers is global (llama.cpp's hparams.set_swa_pattern(N) for these architectures).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2, "llama4": 4}


def swa_layers(
    arch: str, n_layer: int, sliding_window: int, fields: dict[str, Any]
) -> tuple[bool, ...]:
    explicit = fields.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(explicit, list) and len(explicit) >= n_layer:
        return tuple(bool(v) for v in explicit[:n_layer])
    if sliding_window <= 0:
        return (False,) * n_layer
    period = explicit if isinstance(explicit, int) and explicit > 0 else SWA_PATTERN.get(arch)
    if period is None:  # unknown: assume full-size caches, which over-estimates safely
        return (False,) * n_layer
    return tuple(i % period < period - 1 for i in range(n_layer))


# Far above any real model, far below what would overflow an estimate.
_LIMITS = {"block_count": 1 << 14, "embedding_length": 1 << 20, "context_length": 1 << 26}


def _positive(path: Path, key: str, value: Any) -> int:
    if value is None:
        raise InvalidModelFile(f"{path} lacks the required key {key}; export the model again")
    limit = _LIMITS[key.rsplit(".", 1)[-1]]
    if not isinstance(value, int) or value <= 0 or value > limit:
        raise InvalidModelFile(f"{path} has an absurd {key} = {value!r}; export the model again")
    return value


def _quantization(file_type: Any, header: GGUFHeader) -> str:

    if isinstance(file_type, int):
        try:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    # No file type: name the most common tensor type, weighted by size.
    sizes: dict[int, int] = {}
    for tensor in header.tensors:
        sizes[tensor.ggml_type] = sizes.get(tensor.ggml_type, 0) + tensor.n_bytes
    if not sizes:
        return "unknown"
    return GGMLQuantizationType(max(sizes, key=lambda k: sizes[k])).name


def format_params(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)

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

from scheduler.errors import InvalidModelFile
from scheduler.ggufparse import GGUFFormatError, GGUFHeader, SkippedArray, parse_header

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
    info = _parse(path, stat.st_size)
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
    heads = int(get(f"{arch}.attention.head_count", 1) or 1)
    heads_kv = int(get(f"{arch}.attention.head_count_kv", heads) or heads)
    head_dim = embedding // max(heads, 1)
    tokens = fields.get("tokenizer.ggml.tokens")
    n_tokens = tokens.length if isinstance(tokens, SkippedArray) else len(tokens or [])
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
        key_length=int(get(f"{arch}.attention.key_length", head_dim) or head_dim),
        value_length=int(get(f"{arch}.attention.value_length", head_dim) or head_dim),
        vocab_size=int(get(f"{arch}.vocab_size", 0) or n_tokens),
        sliding_window=int(get(f"{arch}.attention.sliding_window", 0) or 0),
        has_chat_template="tokenizer.chat_template" in fields,
    )


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

"""A fast, bounds-checked reader of a GGUF header: key/values and tensor infos.

The `gguf` package's GGUFReader decodes every array element (262,144 tokenizer strings on
Gemma 3: about 11 s); placement needs only scalars, small arrays and tensor sizes, so this
reader skips large arrays by their lengths and takes types and block sizes from `gguf`'s
constants. Pure: bytes in, values out; malformed input raises GGUFFormatError.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAX_ARRAY_DECODE = 4096  # longer arrays are skipped; their length is kept
# string arrays longer than this (a vocabulary, merges) are skipped too: placement reads
# only their lengths and at most the BOS and EOS items (string_item)
MAX_STRINGS_DECODE = 64
_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class SkippedArray:
    """An array too long to decode for placement; its length and place are kept."""

    length: int
    offset: int = -1  # of its first item, in the file
    item_type: int = -1


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int


class _Cursor:
    """Reads from bytes or an mmap without exporting buffers (an mmap must stay closable)."""

    def __init__(self, buf: bytes | mmap.mmap, max_strings: int = MAX_ARRAY_DECODE) -> None:
        self.buf = buf
        self.max_strings = max_strings  # longer string arrays are skipped
        self.size = len(buf)
        self.pos = 0

    def _advance(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"header ends early: needs {n} bytes at offset {self.pos}")
        start = self.pos
        self.pos += n
        return start

    def take_place(self, n: int) -> int:
        """Where the next ``n`` bytes start, stepping past them."""
        return self._advance(n)

    def take(self, n: int) -> bytes:
        start = self._advance(n)
        return bytes(self.buf[start : start + n])

    def skip(self, n: int) -> None:
        self._advance(n)

    def unpack(self, fmt: str) -> Any:
        start = self._advance(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.skip(self.unpack("<Q"))


def parse_header(buf: bytes | mmap.mmap, max_strings: int = MAX_STRINGS_DECODE) -> GGUFHeader:
    """The header; string arrays longer than ``max_strings`` (at most MAX_ARRAY_DECODE) come
    back as :class:`SkippedArray`, as every longer array does."""
    cur = _Cursor(buf, min(max_strings, MAX_ARRAY_DECODE))
    if cur.take(4) != b"GGUF":
        raise GGUFFormatError("wrong magic: not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise GGUFFormatError(f"absurd counts: {n_tensors} tensors, {n_kv} keys")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = _value(cur, cur.unpack("<I"))
    tensors = [_tensor(cur) for _ in range(n_tensors)]
    alignment = int(fields.get("general.alignment", 32) or 32)
    data_offset = -(-cur.pos // alignment) * alignment
    return GGUFHeader(version, fields, tensors, data_offset)


def string_item(buf: bytes | mmap.mmap, array: Any, index: int) -> str:
    """Item ``index`` of a string array (decoded, or skipped: then walked to from its start);
    "" when there is no such item."""
    if isinstance(array, list):
        return str(array[index]) if 0 <= index < len(array) else ""
    if not isinstance(array, SkippedArray) or array.item_type != GGUFValueType.STRING:
        return ""
    if not 0 <= index < array.length:
        return ""
    cur = _Cursor(buf)
    cur.pos = array.offset
    for _ in range(index):
        cur.skip_string()
    return cur.string()


MAX_NESTING = 4  # arrays of arrays deeper than this are not a model's metadata


def _value(cur: _Cursor, vtype: int, depth: int = 0) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        if depth >= MAX_NESTING:
            raise GGUFFormatError(f"arrays nested deeper than {MAX_NESTING} at offset {cur.pos}")
        item_type, length = cur.unpack("<I"), cur.unpack("<Q")
        scalar = _SCALAR.get(item_type)  # an int finds its IntEnum key
        if scalar is not None and length <= MAX_ARRAY_DECODE:  # per-layer numbers: one read
            fmt = f"<{length}{scalar[1]}"
            return list(struct.unpack_from(fmt, cur.buf, cur.take_place(struct.calcsize(fmt))))
        if length <= (cur.max_strings if item_type == GGUFValueType.STRING else MAX_ARRAY_DECODE):
            return [_value(cur, item_type, depth + 1) for _ in range(length)]
        start = cur.pos
        if item_type == GGUFValueType.STRING:
            for _ in range(length):
                cur.skip_string()
        elif item_type in _SCALAR:
            cur.skip(struct.calcsize(_SCALAR[GGUFValueType(item_type)]) * length)
        else:
            raise GGUFFormatError(f"array of type {item_type} is too long to skip")
        return SkippedArray(length, start, item_type)
    try:
        return cur.unpack(_SCALAR[GGUFValueType(vtype)])
    except (KeyError, ValueError):
        raise GGUFFormatError(f"unknown value type {vtype} at offset {cur.pos}") from None


def _tensor(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if n_dims > 8:
        raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
    ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise GGUFFormatError(f"tensor {name!r} has unknown type {ggml_type}") from None
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    return TensorInfo(name, shape, ggml_type, offset, n_elements, n_elements // block * type_size)

"""The GGUF header reader: arrays a placement reads come out as values, arrays it only
sizes (a vocabulary) are skipped and still reachable item by item."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from api_client.gateway.catalog import model_info
from scheduler.gguf.metadata import read_model_info
from scheduler.gguf.parse import (
    MAX_STRINGS_DECODE,
    GGUFFormatError,
    SkippedArray,
    parse_header,
    string_item,
)
from tests.tinymodel import finish, write_tiny_llama


def write(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("t.words", [f"w{i}" for i in range(MAX_STRINGS_DECODE + 36)])
    writer.add_array("t.few", ["a", "bc", "déf"])
    writer.add_array("t.ints", [3, -1, 7, 0])
    writer.add_array("t.floats", [0.5, 1.5, -2.0])
    writer.add_array("t.flags", [True, False])
    writer.add_uint32("t.one", 42)
    writer.add_tensor("x", np.zeros((4, 8), dtype=np.float32))
    return finish(writer, path)


def test_arrays_read_as_placement_needs_them(tmp_path: Path) -> None:
    path = write(tmp_path / "t.gguf")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        header = parse_header(mm)
        fields = header.fields
        words = fields["t.words"]
        assert isinstance(words, SkippedArray) and words.length == MAX_STRINGS_DECODE + 36
        assert [string_item(mm, words, i) for i in (0, 57, words.length - 1)] == [
            "w0",
            "w57",
            f"w{words.length - 1}",
        ]
        assert string_item(mm, words, words.length) == ""
        assert fields["t.few"] == ["a", "bc", "déf"]
        assert fields["t.ints"] == [3, -1, 7, 0]
        assert fields["t.floats"] == [0.5, 1.5, -2.0]
        assert fields["t.flags"] == [True, False]
        assert fields["t.one"] == 42
    (tensor,) = header.tensors
    assert (tensor.name, tensor.n_elements, tensor.n_bytes) == ("x", 32, 128)


def test_a_header_cut_inside_an_array_is_a_format_error(tmp_path: Path) -> None:
    data = write(tmp_path / "t.gguf").read_bytes()
    cut = data.index(b"t.ints") + 20  # inside the array's items
    with pytest.raises(GGUFFormatError, match="ends early"):
        parse_header(data[:cut])


def test_show_lists_the_vocabulary_only_when_verbose(tmp_path: Path) -> None:
    """/api/show's model_info decodes what placement skips (Ollama's verbose view)."""
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    n_vocab = read_model_info(path).vocab_size
    assert n_vocab > MAX_STRINGS_DECODE
    tokens = model_info(path, verbose=True)["tokenizer.ggml.tokens"]
    assert len(tokens) == n_vocab and all(isinstance(t, str) for t in tokens)
    assert model_info(path, verbose=False)["tokenizer.ggml.tokens"] == []

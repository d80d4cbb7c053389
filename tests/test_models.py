"""GGUF metadata and the model registry, on files the tests write."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from scheduler.errors import InvalidModelFile, InvalidRequest, ModelNotFound
from scheduler.gguf.metadata import format_params, read_model_info
from scheduler.gguf.registry import DEMO_MODEL, Registry, demo_installed
from tests.conftest import needs_demo


def test_tiny_model_metadata(models_dir: Path) -> None:
    info = read_model_info(models_dir / "tiny.gguf")
    assert info.architecture == "llama"
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (
        2,
        64,
        4,
        2,
    )
    assert info.context_length == 2048
    assert info.quantization == "F32"
    assert info.vocab_size == 3 + 256 + 35
    assert info.has_chat_template
    assert 100_000 < info.parameter_count < 200_000
    assert info.file_size == (models_dir / "tiny.gguf").stat().st_size


@pytest.mark.parametrize(
    ("name", "message"),
    [("notgguf", "is not a GGUF file"), ("truncated", "truncated")],
)
def test_bad_files_name_file_and_problem(models_dir: Path, name: str, message: str) -> None:
    with pytest.raises(InvalidModelFile) as info:
        read_model_info(models_dir / f"{name}.gguf")
    assert message in str(info.value)
    assert f"{name}.gguf" in str(info.value)


def test_header_cut_short(tmp_path: Path, models_dir: Path) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes((models_dir / "tiny.gguf").read_bytes()[:200])
    with pytest.raises(InvalidModelFile, match="short.gguf.*(truncated|ends early)"):
        read_model_info(path)


def test_absurd_values_are_refused(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "absurd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint64("llama.context_length", 10**12)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidModelFile, match="absurd llama.context_length"):
        read_model_info(path)


def test_metadata_of_the_wrong_type_names_its_key(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "typed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_string("llama.attention.head_count", "four")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidModelFile) as refused:
        read_model_info(path)
    message = str(refused.value)
    assert "llama.attention.head_count = 'four' (str) where a number belongs" in message
    assert "ValueError" not in message and "export the model again" in message


def hostile_gguf(path: Path, *kvs: bytes) -> Path:
    """A GGUF header written by hand: version 3, no tensors, the given key-value pairs."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + b"\0" * 64)
    return path


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


ARRAY, STRING, UINT32 = 9, 8, 4  # GGUF value types


def test_hostile_headers_are_typed_errors_naming_the_file(tmp_path: Path, models_dir: Path) -> None:
    nesting = struct.pack("<IQ", ARRAY, 1) * 64 + struct.pack("<IQ", UINT32, 0)
    deep = hostile_gguf(
        tmp_path / "deep.gguf", gguf_string("general.nested") + struct.pack("<I", ARRAY) + nesting
    )
    typed = hostile_gguf(
        tmp_path / "typed.gguf",
        gguf_string("general.architecture") + struct.pack("<I", STRING) + gguf_string("llama"),
        gguf_string("llama.block_count") + struct.pack("<I", STRING) + gguf_string("four"),
    )
    with pytest.raises(InvalidModelFile, match=r"deep.gguf .*nested deeper"):
        read_model_info(deep)
    with pytest.raises(InvalidModelFile, match=r"typed.gguf"):
        read_model_info(typed)
    # one bad file leaves the others usable in the listing
    (tmp_path / "good.gguf").write_bytes((models_dir / "tiny.gguf").read_bytes())
    entries = {e.name: e for e in Registry(tmp_path).entries()}
    assert entries["deep"].error and entries["typed"].error
    assert entries["good"].error is None and entries["good"].info is not None


def test_registry_lists_and_resolves(models_dir: Path) -> None:
    registry = Registry(models_dir)
    names = registry.names()
    assert {"tiny", "notgguf", "truncated", "alien"} <= set(names)
    assert (DEMO_MODEL in names) == demo_installed()
    assert registry.resolve("tiny") == models_dir / "tiny.gguf"
    entries = {e.name: e for e in registry.entries()}
    assert entries["tiny"].info is not None and entries["tiny"].error is None
    assert entries["notgguf"].info is None and "not a GGUF file" in (entries["notgguf"].error or "")


def test_unknown_model_lists_available(models_dir: Path) -> None:
    with pytest.raises(ModelNotFound) as info:
        Registry(models_dir).resolve("llama3")
    assert "'llama3' not found" in str(info.value)
    assert "tiny" in str(info.value) and str(models_dir) in str(info.value)


def test_paths_refused_by_registry(models_dir: Path) -> None:
    with pytest.raises(InvalidRequest, match="file path"):
        Registry(models_dir).resolve("../models/tiny")


def test_missing_models_dir_says_create_it(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="create"):
        Registry(tmp_path / "nope").resolve("x")


def test_format_params() -> None:
    assert format_params(268_098_176) == "268.1M"
    assert format_params(7_241_732_096) == "7.2B"


@needs_demo
def test_demo_model_metadata() -> None:
    info = Registry(Path("/nonexistent")).info(DEMO_MODEL)
    assert info.architecture == "gemma3"
    assert info.quantization == "Q4_K_M"
    assert info.sliding_window == 512 and info.block_count == 18
    assert info.vocab_size == 262_144

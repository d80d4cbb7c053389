"""Names as Ollama's clients use them: two names of one GGUF file are one model and share
its runners (Ollama shares by digest), and ``name:latest`` is ``name``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api_client import Client
from scheduler.gguf.registry import Registry
from scheduler.local.stack import LocalStack
from tests.conftest import wait_for
from tests.gateway_server import running_gateway


@pytest.fixture(scope="module")
def alias(models_dir: Path) -> Iterator[str]:
    """``tiny-alias``: a symlink to tiny's file (put beside the session's models, then gone)."""
    link = models_dir / "tiny-alias.gguf"
    link.symlink_to(models_dir / "tiny.gguf")
    yield "tiny-alias"
    link.unlink()


def test_names_of_one_file_are_its_first_name(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    os.link(tmp_path / "b.gguf", tmp_path / "c.gguf")  # a hard link
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "d.gguf").write_bytes(b"GGUF")  # same bytes, another file: another model
    registry = Registry(tmp_path)
    # a file's own name before a symlink's, then in order of names
    assert [registry.first_name(n) for n in "abcd"] == ["b", "b", "b", "d"]
    assert registry.first_name("elsewhere") == "elsewhere"  # not here: as named


def test_two_names_of_one_file_share_one_runner(
    stack: LocalStack, client: Client, alias: str
) -> None:
    options = {"temperature": 0, "num_predict": 2, "num_ctx": 640}
    with running_gateway(stack.settings) as url:
        first = httpx.post(
            f"{url}/api/generate",
            json={"model": "tiny", "prompt": "hi", "stream": False, "options": options},
            timeout=60,
        )
        before = {r.id for r in client.ps()}
        second = httpx.post(
            f"{url}/api/generate",
            json={"model": f"{alias}:latest", "prompt": "hi", "stream": False, "options": options},
            timeout=60,
        )
    assert first.status_code == second.status_code == 200
    assert second.json()["model"] == f"{alias}:latest"  # each answer names what was asked
    assert second.json()["response"] == first.json()["response"]
    assert {r.id for r in client.ps()} == before  # no runner loaded for the second name
    assert all(r.model != alias for r in client.ps())
    # unloading by the other name unloads the shared runner
    with running_gateway(stack.settings) as url:
        unload = httpx.post(
            f"{url}/api/generate", json={"model": alias, "keep_alive": 0}, timeout=60
        )
    assert unload.json()["done_reason"] == "unload"
    assert wait_for(
        lambda: not any(r.model == "tiny" and r.context_length == 640 for r in client.ps())
    )

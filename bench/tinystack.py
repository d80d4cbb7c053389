"""What the benches that run a stack of tiny generated models share: a fresh state
directory with its models, and waiting for a gateway to answer."""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def tiny_state(prefix: str) -> tuple[Path, Any]:
    """A fresh state directory with an empty ``models`` folder, and tests/tinymodel.py
    (its writers of tiny GGUF models)."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    (state / "models").mkdir()
    return state, importlib.import_module("tests.tinymodel")


def tiny_models(models: Path, n: int) -> None:
    """``n`` tiny llamas in ``models``, m0000.gguf on: one file written, the others hard
    links to it (each a model of its own to placement)."""
    first = importlib.import_module("tests.tinymodel").write_tiny_llama(models / "m0000.gguf")
    for i in range(1, n):
        os.link(first, models / f"m{i:04d}.gguf")


def tiny_llama_state(prefix: str, model: str, **env: str) -> tuple[Path, dict[str, str]]:
    """A fresh state directory holding one tiny llama, ``models/<model>.gguf``, and a
    stack's environment on it: its state and models folders, no metrics port, and ``env``
    (``GGUFQ_*`` names, values as strings)."""
    state, tiny = tiny_state(prefix)
    tiny.write_tiny_llama(state / "models" / f"{model}.gguf")
    base = {
        "GGUFQ_STATE_DIR": str(state),
        "GGUFQ_MODELS_DIR": str(state / "models"),
        "GGUFQ_METRICS_PORT": "0",
    }
    return state, {**base, **env}


def wait_answering(base: str, seconds: float = 30.0) -> None:
    """Return once the gateway at ``base`` answers (or ``seconds`` passed)."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(base, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)

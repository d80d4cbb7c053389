"""What the benches that run a stack of tiny generated models share: a fresh state
directory with its models, and waiting for a gateway to answer."""

from __future__ import annotations

import importlib
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

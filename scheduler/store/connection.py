"""Where this host's local stack keeps its Redis URL, so that every command finds it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from scheduler.errors import StackNotRunning
from scheduler.settings import Settings


def runtime_file(settings: Settings) -> Path:
    return Path(settings.state_dir).expanduser() / "stack.json"


def write_runtime(settings: Settings, redis_url: str) -> None:
    path = runtime_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"redis_url": redis_url, "pid": os.getpid()}))


def clear_runtime(settings: Settings) -> None:
    path = runtime_file(settings)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def resolve_redis_url(settings: Settings) -> str:
    """GGUFQ_REDIS_URL if set, else the Redis of the local stack started by `ggufq up`."""
    if settings.redis_url:
        return settings.redis_url
    path = runtime_file(settings)
    try:
        record = json.loads(path.read_text())
        os.kill(int(record["pid"]), 0)
        return str(record["redis_url"])
    except (OSError, ValueError, KeyError, TypeError):
        raise StackNotRunning(
            "no ggufq stack is running on this host and GGUFQ_REDIS_URL is not set; start one "
            "with `ggufq up` (or point GGUFQ_REDIS_URL at the Redis of a running stack)"
        ) from None

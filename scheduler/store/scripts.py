"""The Lua scripts in ``lua/``: every change to devices, runners and reservations goes
through one, so any number of placement processes and workers never over-commit a device."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis
import redis.asyncio


@cache
def _lua_source(name: str) -> str:
    folder = resources.files("scheduler.store").joinpath("lua")
    # the preludes: every script logs the keys it changes (placement's snapshot cache reads
    # that log), and may count a model's demand
    preludes = [folder.joinpath(f"_{part}.lua").read_text() for part in ("changes", "demand")]
    return "".join(preludes) + folder.joinpath(f"{name}.lua").read_text()


def script(client: redis.Redis | redis.asyncio.Redis, name: str) -> Any:
    """The script ``lua/<name>.lua`` registered on ``client`` (loaded on first call; a
    redis.asyncio client's is awaited)."""
    return client.register_script(_lua_source(name))


def flatten(fields: dict[str, Any]) -> list[Any]:
    """A mapping as the flat key, value, ... argument list scripts read."""
    flat: list[Any] = []
    for key, value in fields.items():
        flat += [key, value]
    return flat

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


_SOURCES: dict[str, Any] = {}  # sha1 → source, of every script made by script()


def script(client: redis.Redis | redis.asyncio.Redis, name: str) -> Any:
    """The script ``lua/<name>.lua`` registered on ``client`` (loaded on first call; a
    redis.asyncio client's is awaited)."""
    registered = client.register_script(_lua_source(name))
    _SOURCES[registered.sha] = registered.script
    return registered


def queue(pipe: Any, registered: Any, keys: list[str], args: list[Any]) -> None:
    """Queue a script made by :func:`script` on ``pipe`` by its hash alone. redis-py's own
    way (``registered(..., client=pipe)``) asks Redis SCRIPT EXISTS before the pipeline: one
    more round trip each time. Run the pipeline with :func:`execute`."""
    pipe.evalsha(registered.sha, len(keys), *keys, *args)


def execute(pipe: Any) -> list[Any]:
    """Run ``pipe`` (a non-transactional pipeline) as ``pipe.execute()`` does, except that a
    script Redis does not have (it restarted without them) is loaded and that command
    alone run again: it did not run, and the pipeline's other commands did."""
    commands = [args for args, _options in pipe.command_stack]
    results = list(pipe.execute(raise_on_error=False))
    try:
        for i, (command, result) in enumerate(zip(commands, results, strict=True)):
            source = _SOURCES.get(command[1]) if command[0] == "EVALSHA" else None
            if isinstance(result, redis.exceptions.NoScriptError) and source is not None:
                pipe.immediate_execute_command("SCRIPT LOAD", source)
                results[i] = pipe.immediate_execute_command(*command)
    finally:
        pipe.reset()  # the connection those took goes back to the pool
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def flatten(fields: dict[str, Any]) -> list[Any]:
    """A mapping as the flat key, value, ... argument list scripts read."""
    flat: list[Any] = []
    for key, value in fields.items():
        flat += [key, value]
    return flat

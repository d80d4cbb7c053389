"""The Lua scripts in ``lua/``: every change to devices, runners and reservations goes
through one, so any number of placement processes and workers never over-commit a device."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis
import redis.asyncio

from scheduler.custody import ENDED, transitions_of

# scripts that call no prelude, given none: a reader's look (24 KB of preludes would cost
# it ten times what it reads)
BARE = frozenset({"whereabouts"})


@cache
def _lua_source(name: str) -> str:
    folder = resources.files("scheduler.store").joinpath("lua")
    if name in BARE:
        return folder.joinpath(f"{name}.lua").read_text()
    # the preludes: every script logs the keys it changes (placement's snapshot cache reads
    # that log), and may count a model's demand, let go of a job in hand, read Redis's
    # clock, keep custody deadlines, move a job's custody record, count a runner's jobs, or
    # take the steps of a job's end
    parts = ("changes", "demand", "hands", "clock", "due", "custody", "jobs", "ends")
    preludes = [folder.joinpath(f"_{part}.lua").read_text() for part in parts]
    return custody_tables(name) + "".join(preludes) + folder.joinpath(f"{name}.lua").read_text()


def custody_tables(script: str) -> str:
    """The moves of the custody table (scheduler/custody.py) that ``script`` makes, as the
    Lua set lua/_custody.lua checks each of its moves against (any other is refused), and
    the ended states: written from the one table, never copied by hand."""
    moves = sorted(transitions_of(script))
    ended = sorted(state.value for state in ENDED)
    return (
        "local CUSTODY_MOVES = {" + ", ".join(f"[{m!r}] = true" for m in moves) + "}\n"
        "local CUSTODY_ENDED = {" + ", ".join(f"[{e!r}] = true" for e in ended) + "}\n"
    )


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


def execute(pipe: Any, raise_on_error: bool = True) -> list[Any]:
    """Run ``pipe`` (a non-transactional pipeline) as ``pipe.execute()`` does, except that
    scripts Redis does not have (it restarted without them) are loaded and the commands
    that ran them run again, in one more round trip: they did not run, and the pipeline's
    other commands did."""
    commands = [args for args, _options in pipe.command_stack]
    results = list(pipe.execute(raise_on_error=False))
    again = [
        i
        for i, result in enumerate(results)
        if isinstance(result, redis.exceptions.NoScriptError)
        and commands[i][0] == "EVALSHA"
        and commands[i][1] in _SOURCES
    ]
    if again:
        lost = sorted({commands[i][1] for i in again})
        for sha in lost:
            pipe.execute_command("SCRIPT LOAD", _SOURCES[sha])
        for i in again:
            pipe.execute_command(*commands[i])
        rerun = pipe.execute(raise_on_error=False)[len(lost) :]
        for i, result in zip(again, rerun, strict=True):
            results[i] = result
    if raise_on_error:
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

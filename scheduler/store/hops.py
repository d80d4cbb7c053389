"""Per-hop timestamps of one job: where its time to first token went.

Each process on a job's path notes when the job passed it (wall-clock seconds, so that
processes and hosts compare as far as their clocks agree) and writes the notes with a write
it makes anyway, off the job's path to its first token. ``Job.hops()`` reads them back with
the reader's own last hop; ``bench/overhead.py`` prints the gaps between them.
"""

from __future__ import annotations

import time
from typing import Any, cast

import redis

from scheduler.store import keys

# the hops in the order a job passes them (a job that skips placement's queue, on the fast
# path, has no placement_received nor decided: its client notes sent, as it runs the script)
HOPS = (
    "submitted",  # the client made the request
    "placement_received",  # placement took its message off the queue
    "decided",  # placement committed where it runs
    "sent",  # its message is in the device's queue
    "worker_received",  # the worker's task began
    "admitted",  # the runner gave it a slot
    "first_token",  # the runner produced its first text
    "first_chunk_written",  # the worker had that text in Redis (or sent it there at once)
    "first_chunk_read",  # the reader had it (noted in the reader's process only)
)

# perf_counter readings (CLOCK_MONOTONIC) as wall-clock seconds in this process
_WALL_OFFSET = time.time() - time.perf_counter()


def wall(perf_ns: int) -> float:
    """A ``time.perf_counter_ns()`` reading of this process as wall-clock seconds."""
    return _WALL_OFFSET + perf_ns / 1e9


def note(pipe: Any, job_id: str, ttl_s: int, hops: dict[str, float]) -> None:
    """Queue on ``pipe`` the writing of some of a job's hops."""
    if hops:
        key = keys.job_hops(job_id)
        pipe.hset(key, mapping={name: f"{at:.6f}" for name, at in hops.items()})
        pipe.expire(key, ttl_s)


def read(client: redis.Redis, job_id: str) -> dict[str, float]:
    """The hops recorded for a job, in path order."""
    raw = cast(dict[bytes, bytes], client.hgetall(keys.job_hops(job_id)))
    found = {k.decode(): float(v) for k, v in raw.items()}
    return ordered(found)


def ordered(hops: dict[str, float]) -> dict[str, float]:
    return {name: hops[name] for name in HOPS if name in hops}


def gaps_ms(hops: dict[str, float], order: tuple[str, ...] = HOPS) -> dict[str, float]:
    """Milliseconds from each recorded hop to the next one recorded, named ``a→b``."""
    names = [n for n in order if n in hops]
    return {f"{a}→{b}": (hops[b] - hops[a]) * 1000 for a, b in zip(names, names[1:], strict=False)}

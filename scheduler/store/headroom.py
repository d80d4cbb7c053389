"""Room in Redis for a new job. Redis runs with a ``maxmemory`` and ``noeviction``: past it
every write is refused, those of the jobs already running included. So a large job is
admitted only while Redis has room for its text several times over (it travels through
its claim, its parked record, its in-flight record, its Celery message and its result),
and a write refused for memory reaches the caller as :class:`ServerBusy` naming the
cause, never as redis-py's error. Small jobs are not looked at (a look is a round trip):
they fit in the margin kept below the limit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from scheduler.errors import ServerBusy
from scheduler.units import format_bytes

COPIES = 6  # records a job's text is in on its way, at most at once
LOOK_FROM_BYTES = 64 << 10  # a job's text smaller than this is admitted without a look
MARGIN = 0.9  # admitted while used + COPIES x the job's bytes stay under this x maxmemory


def refusal(used: int, maxmemory: int, job_bytes: int) -> ServerBusy | None:
    """Why a job of ``job_bytes`` may not come in now (None: it may). Pure."""
    needed = COPIES * job_bytes
    if maxmemory <= 0 or used + needed <= MARGIN * maxmemory:
        return None
    return ServerBusy(
        f"Redis has {format_bytes(max(0, maxmemory - used))} left of its maxmemory "
        f"{format_bytes(maxmemory)}, and this job's text ({format_bytes(job_bytes)}) needs "
        f"about {format_bytes(needed)} on its way: try again when jobs ahead of it have "
        "ended, send a smaller job, or raise Redis's maxmemory (GGUFQ_REDIS_MAXMEMORY)"
    )


def admit(r: redis.Redis, job_bytes: int) -> None:
    """Raise :class:`ServerBusy` when Redis has no room for a job of ``job_bytes``."""
    if job_bytes < LOOK_FROM_BYTES:
        return
    memory: dict[str, Any] = r.info("memory")
    busy = refusal(int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0)), job_bytes)
    if busy is not None:
        raise busy


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write for memory (a command's, or a script's)."""
    return isinstance(exc, redis.OutOfMemoryError) or "OOM command not allowed" in str(exc)


@contextmanager
def refused_for_memory() -> Iterator[None]:
    """Around a job's first writes: Redis refusing them for memory is :class:`ServerBusy`."""
    try:
        yield
    except Exception as exc:
        if not is_full(exc):
            raise
        raise ServerBusy(
            "Redis is full (its maxmemory is reached, and it evicts nothing): this job was not "
            "sent; try again when jobs ahead of it have ended, or raise Redis's maxmemory "
            "(GGUFQ_REDIS_MAXMEMORY)"
        ) from None

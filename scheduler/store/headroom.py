"""Room in Redis for a new job. Redis runs with a ``maxmemory`` and ``noeviction``: past it
every write is refused, those of the jobs already running included. So a large job is
admitted only while Redis has room for its text ten times over (COPIES), counting the
jobs admitted in the last seconds, in one step (``lua/admit.lua``: jobs arriving at once
cannot all see the same room); and a write refused for memory reaches the caller as
:class:`ServerBusy` naming the cause, never as redis-py's error. Small jobs are not looked
at (a look is a round trip): they fit in the margin kept below the limit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from scheduler.errors import ServerBusy
from scheduler.store import keys
from scheduler.store.scripts import script
from scheduler.units import format_bytes

# records a job's text is in on its way, at most at once: its claim, its placement and
# device queues' messages (base64, a third larger) and their unacknowledged copies, its
# parked record, its hold, its in-flight record, its stream and result
COPIES = 10
COUNTED_S = 10  # a job admitted is counted this long (its records are written by then)
LOOK_FROM_BYTES = 64 << 10  # a job's text smaller than this is admitted without a look
MARGIN = 0.9  # admitted while used + COPIES x the job's bytes stay under this x maxmemory


def refusal(used: int, maxmemory: int, job_bytes: int) -> ServerBusy:
    """Why a job of ``job_bytes`` may not come in now (``used``: what Redis uses and what
    was admitted lately)."""
    needed = COPIES * job_bytes
    return ServerBusy(
        f"Redis has {format_bytes(max(0, maxmemory - used))} left of its maxmemory "
        f"{format_bytes(maxmemory)}, and this job's text ({format_bytes(job_bytes)}) needs "
        f"about {format_bytes(needed)} on its way: try again when jobs ahead of it have "
        "ended, send a smaller job, or raise Redis's maxmemory (GGUFQ_REDIS_MAXMEMORY)"
    )


def admit(r: redis.Redis, job_bytes: int) -> None:
    """Raise :class:`ServerBusy` when Redis has no room for a job of ``job_bytes``; else
    count the room it takes (one step: jobs arriving at once each see the others')."""
    if job_bytes < LOOK_FROM_BYTES:
        return
    argv = [COPIES * job_bytes, MARGIN, COUNTED_S]
    ok, used, maxmemory = script(r, "admit")(keys=[keys.MEMORY_ADMITTED], args=argv)
    if not ok:
        raise refusal(int(used), int(maxmemory), job_bytes)


def is_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Redis refusing a write for memory: a command's, a script's, or
    either as Celery's sending wraps it (kombu's OperationalError, caused by it)."""
    for _ in range(8):  # the error, and what caused it
        if exc is None:
            return False
        if isinstance(exc, redis.OutOfMemoryError) or "used memory > 'maxmemory'" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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

"""``python -m tests.held_worker ARGS...``: the real worker (``ggufq worker ARGS...``), in which
a job whose prompt starts with ``HOLD:`` stops after its first piece of text, still
running, until it is cancelled or the test releases it (:func:`release`); and, while the
test holds loads (:func:`hold_loads`), a model's load stops at its first progress, inside
llama.cpp's own load, until the test lets it go on (:func:`let_loads_go`).

A test that acts on a running job (kills its reader, cancels it, kills its worker) must
find it running: a job held here waits on the event the test controls instead of on the
machine being slow enough to still be generating. Everything else is the worker's own:
the job is claimed, streams its first chunk, sees its cancel, and ends as any other.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import redis

import workers.generation as generation
from scheduler.store.connection import connect
from workers.loadwatch import LoadWatch
from workers.main import main

HOLD = "HOLD:"
HOLD_LOADS = "ggufq:test:hold-loads"


def hold_loads(client: redis.Redis) -> None:
    """The loads that start from now on stop at their first progress until
    :func:`let_loads_go`."""
    client.set(HOLD_LOADS, 1, ex=600)


def let_loads_go(client: redis.Redis) -> None:
    client.delete(HOLD_LOADS)


def hold_loads_while_asked() -> None:
    progress = LoadWatch.progress
    client = connect(os.environ["GGUFQ_REDIS_URL"])  # plain, or behind Sentinel

    def held(watch: LoadWatch, fraction: float) -> bool:
        going_on = progress(watch, fraction)
        if 0 < fraction < 1 and not getattr(watch, "held", False):
            watch.held = True  # type: ignore[attr-defined]
            # its first progress is on the runner's record, as reported
            while client.exists(HOLD_LOADS):
                threading.Event().wait(0.02)
            watch.last_progress = watch.clock()  # the held time is not a stall
        return going_on

    LoadWatch.progress = held  # type: ignore[method-assign,assignment]


def release_key(job_id: str) -> str:
    return f"ggufq:test:release:{job_id}"  # in the cluster keys a worker's ACL user may touch


def release(client: redis.Redis, job_id: str) -> None:
    """Let a held job go on generating."""
    client.set(release_key(job_id), 1, ex=600)


def released(client: redis.Redis, job_id: str) -> bool:
    """Whether the test let the job go on; not while Redis is away (a failover): the job
    stays held, as a worker's own code rides an outage out, never failing the job."""
    try:
        return bool(client.exists(release_key(job_id)))
    except redis.RedisError:
        return False


def hold_marked_jobs() -> None:
    generate = generation.generate

    def held(req: Any, runner: Any, publisher: Any, cancelled: Any, prompt: str, *rest: Any) -> Any:
        if not prompt.startswith(HOLD):
            return generate(req, runner, publisher, cancelled, prompt, *rest)
        publish = publisher.publish
        first = threading.Event()

        def then_hold(chunk: dict[str, Any]) -> None:
            publish(chunk)
            if first.is_set() or not chunk.get("response"):
                return
            first.set()
            publisher.flush()  # its first text is out for its reader before it holds
            # on the decode thread, so the runner's other sequences wait too
            while not cancelled() and not released(publisher.r, req.id):
                threading.Event().wait(0.02)

        publisher.publish = then_hold
        return generate(req, runner, publisher, cancelled, prompt, *rest)

    generation.generate = held  # type: ignore[assignment]


if __name__ == "__main__":
    hold_marked_jobs()
    hold_loads_while_asked()
    main(sys.argv[1:])

"""``python -m tests.held_worker ARGS...``: the real worker (``ggufq worker ARGS...``), in which
a job whose prompt starts with ``HOLD:`` stops after its first piece of text (``HOLD@N:``
after its Nth generated token, its text up to there in Redis), still running, until it is
cancelled or the test releases it (:func:`release`); and, while the test holds loads
(:func:`hold_loads`), a model's load stops at its first progress, inside llama.cpp's own
load, until the test lets it go on (:func:`let_loads_go`).

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

import workers.engine.relay as relay
import workers.generation as generation
from scheduler.store.connection import connect
from workers.loadwatch import LoadWatch
from workers.main import main

HOLD = "HOLD:"
HOLD_AFTER = "HOLD@"  # HOLD@N: held after its Nth generated token
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


def held_key(job_id: str) -> str:
    return f"ggufq:test:held:{job_id}"


def is_held(client: redis.Redis, job_id: str) -> bool:
    """Whether the job is held now, all it published before in Redis."""
    return bool(client.exists(held_key(job_id)))


def _hold(publisher: Any, cancelled: Any) -> None:
    """Hold a job here, on its runner's text relay (its decode loop, and the runner's
    other sequences, wait too once the relay is workers/engine/relay.LAG steps behind),
    once what it published is in Redis, until it is cancelled or released. A run on a
    resident runner holds its chunks back until its start is claimed, beside its first
    steps, on the job's thread: under load that can come after the hold's token."""
    while publisher.holding and not cancelled():
        threading.Event().wait(0.01)
    publisher.flush()
    try:  # a sign for the test; Redis may be going away (a failover the test makes)
        publisher.r.set(held_key(publisher.job_id), 1, ex=600)
    except redis.RedisError:
        pass
    while not cancelled() and not released(publisher.r, publisher.job_id):
        threading.Event().wait(0.02)


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
        if prompt.startswith(HOLD_AFTER) and not req.resumed:  # held on its first run only
            after = int(prompt[len(HOLD_AFTER) :].split(":")[0])
            _AFTER[req.id] = (publisher, cancelled, after)
            try:
                return generate(req, runner, publisher, cancelled, prompt, *rest)
            finally:
                _AFTER.pop(req.id, None)
        if not prompt.startswith(HOLD):
            return generate(req, runner, publisher, cancelled, prompt, *rest)
        publish = publisher.publish
        first = threading.Event()

        def then_hold(chunk: dict[str, Any]) -> None:
            publish(chunk)
            if first.is_set() or not chunk.get("response"):
                return
            first.set()
            _hold(publisher, cancelled)  # its first text is out for its reader before

        publisher.publish = then_hold
        return generate(req, runner, publisher, cancelled, prompt, *rest)

    generation.generate = held  # type: ignore[assignment]


# a HOLD@N: job's id -> (its publisher, its cancelled(), N)
_AFTER: dict[str, tuple[Any, Any, int]] = {}


def hold_after_tokens() -> None:
    made = relay.TextRelay._token

    def text_made(self: Any, job: Any, token: int, piece: bytes) -> None:
        before = len(job.out)
        made(self, job, token, piece)
        held = next((h for h in _AFTER.values() if h[0].tokens is job.out), None)
        if held is not None and before < len(job.out) == held[2]:  # its Nth token, once
            _hold(held[0], held[1])

    relay.TextRelay._token = text_made  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_marked_jobs()
    hold_after_tokens()
    hold_loads_while_asked()
    main(sys.argv[1:])

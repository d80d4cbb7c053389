"""Celery's stored results as Redis sees them: where a job's result lives, whether it is final.

The sync batch loop and the asyncio client wait on these keys (and their pub/sub channels)
instead of Celery's own polling, so many waiting jobs cost one subscription each.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, states


def result_key(app: Celery, job_id: str) -> str:
    """The Redis key (and pub/sub channel) of a job's Celery result."""
    key = app.backend.get_key_for_task(job_id)
    return key.decode() if isinstance(key, bytes) else str(key)


def stored(app: Celery, raw: bytes | str) -> tuple[str, Any]:
    """A stored Celery result's state and value, as ``AsyncResult.get(propagate=False)``
    gives them (an error state's value rebuilt as its exception), without Celery's result
    consumer, which subscribes a connection of its own in every thread that asks."""
    meta = app.backend.decode_result(raw)
    value = meta.get("result")
    if meta.get("status") in states.EXCEPTION_STATES:
        value = app.backend.exception_to_python(value)
    return str(meta.get("status")), value


def result_ready(app: Celery, raw: bytes | str | None) -> bool:
    """Whether a stored Celery result (as read from its key) is final."""
    if raw is None:
        return False
    meta = app.backend.decode_result(raw)
    return meta.get("status") in states.READY_STATES

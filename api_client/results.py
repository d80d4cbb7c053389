"""Celery's stored results as Redis sees them: where a job's result lives, whether it is final.

The sync batch loop and the asyncio client wait on these keys (and their pub/sub channels)
instead of Celery's own polling, so many waiting jobs cost one subscription each.
"""

from __future__ import annotations

from typing import Any, Protocol

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


# looks in a row that find a job's stream ended and no result before a reader takes the
# stream's final chunk as the result (its worker stores the result just after it)
STREAM_END_LOOKS = 3


class Ends(Protocol):
    def stream_end(self) -> dict[str, Any] | None:
        """The stream's final chunk, when it has ended (api_client/job.py's Job)."""


class StreamEnds:
    """A waiting reader's looks at its job's stream: the final chunk once STREAM_END_LOOKS
    looks in a row found the stream ended and the reader still had no result."""

    def __init__(self, job: Ends) -> None:
        self.job = job
        self.looks = 0

    def look(self) -> dict[str, Any] | None:
        return self.seen(self.job.stream_end())

    def seen(self, end: dict[str, Any] | None) -> dict[str, Any] | None:
        """The final chunk once this is the STREAM_END_LOOKS-th look in a row to find it."""
        self.looks = self.looks + 1 if end is not None else 0
        return end if self.looks >= STREAM_END_LOOKS else None

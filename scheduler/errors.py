"""The one exception hierarchy of ggufq.

Every class takes a single message argument so that Celery's JSON result backend can
rebuild it on the client side (it re-creates exceptions as ``cls(*args)``).
Messages name the values involved and say what to do.
"""

from __future__ import annotations

from typing import Any


class GgufqError(Exception):
    """Base of every error ggufq raises on purpose."""

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequest(GgufqError):
    """A request or option is malformed or out of range."""

    code = "invalid_request"


def job_id_taken(job_id: str) -> InvalidRequest:
    """The error of a job submitted with the id of a job submitted earlier."""
    return InvalidRequest(
        f"job id {job_id!r} is already taken by a job submitted earlier; "
        "choose another id, or leave it out and one is made for you"
    )


class ModelNotFound(GgufqError):
    """The model name is not in the registry."""

    code = "model_not_found"


class InvalidModelFile(GgufqError):
    """The model file exists but is not a usable GGUF file."""

    code = "invalid_model_file"


class ServerBusy(GgufqError):
    """Too many jobs are waiting; try again later."""

    code = "server_busy"


class NoCapacity(GgufqError):
    """The model cannot fit on any device, even with everything else unloaded."""

    code = "no_capacity"


class NoWorkers(GgufqError):
    """No worker or placement service is alive."""

    code = "no_workers"


class StackNotRunning(GgufqError):
    """No Redis URL is configured and no local stack is running."""

    code = "stack_not_running"


class RedisUnavailable(GgufqError):
    """ggufq's Redis does not answer (down, a wrong URL, a wrong password)."""

    code = "redis_unavailable"


class StackFailed(GgufqError):
    """The local stack (embedded Redis, placement, workers) could not start."""

    code = "stack_failed"


class LoadFailed(GgufqError):
    """llama.cpp could not load the model."""

    code = "load_failed"


class JobFailed(GgufqError):
    """The job ran but ended in an error."""

    code = "job_failed"


class JobLost(JobFailed):
    """Redis no longer knows the job (restarted without its data, or the record expired),
    or holds it nowhere its custody record says (scheduler/store/whereabouts.py)."""

    code = "job_lost"


class ChunksLost(GgufqError):
    """Part of a job's stream is gone: the reader cannot give the text without a hole."""

    code = "chunks_lost"


class JobCancelled(GgufqError):
    """The job was cancelled before it finished."""

    code = "job_cancelled"


class JobTimeout(GgufqError):
    """The caller stopped waiting for the job."""

    code = "job_timeout"


class NotFound(GgufqError):
    """No file or batch of the caller's with that id."""

    code = "not_found"


class Conflict(GgufqError):
    """What was asked cannot be done in the state it is in (a batch that ended already)."""

    code = "conflict"


class BadSettings(GgufqError):
    """A GGUFQ_ environment variable (or .env entry) holds a value ggufq cannot use."""

    code = "bad_settings"


ERRORS_BY_CODE: dict[str, type[GgufqError]] = {
    cls.code: cls
    for cls in (
        GgufqError,
        InvalidRequest,
        ModelNotFound,
        InvalidModelFile,
        ServerBusy,
        NoCapacity,
        NoWorkers,
        StackNotRunning,
        RedisUnavailable,
        StackFailed,
        LoadFailed,
        JobFailed,
        JobLost,
        ChunksLost,
        JobCancelled,
        JobTimeout,
        BadSettings,
    )
}


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was: an error
    names what it got without echoing a megabyte back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} items" if isinstance(value, list | dict) else f"{len(text):,} chars"
    return f"{text[: limit // 2]}… ({size})"


def error_from_code(code: str, message: str) -> GgufqError:
    """Rebuild an error sent over the wire as ``{"code": ..., "message": ...}``."""
    return ERRORS_BY_CODE.get(code, GgufqError)(message)

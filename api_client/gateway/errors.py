"""ggufq's errors as HTTP answers, in the shape of each API, so that clients retry correctly.

Before a response has begun, an error is a status code (404 model not found, 400 invalid,
503 with Retry-After when busy or without workers, 500 when the job failed, 504 on a timeout)
and a body: Ollama's ``{"error": "..."}`` or OpenAI's ``{"error": {"message", "type",
"param", "code"}}``. After a stream has begun the status is sent already: the error goes
in-stream (an NDJSON line, an SSE ``error`` event), as each API does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.errors import (
    ChunksLost,
    Conflict,
    GgufqError,
    InvalidModelFile,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    JobTimeout,
    LoadFailed,
    ModelNotFound,
    NoCapacity,
    NotFound,
    NoWorkers,
    RedisUnavailable,
    ServerBusy,
    StackNotRunning,
)

if TYPE_CHECKING:
    from api_client.gateway.loads import LoadProgress

RETRY_AFTER_S = 5  # what a busy pool asks clients to wait before they try again


class Unauthorized(GgufqError):
    """No API key, or one that is not (or no longer) valid."""

    code = "invalid_api_key"


class JobNotFound(GgufqError):
    """No job of the caller's with that id is waiting or running."""

    code = "job_not_found"


class Forbidden(GgufqError):
    """The API key may not use this model."""

    code = "model_not_allowed"


class RateLimited(GgufqError):
    """The API key is past its requests per minute or its jobs in flight."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotPermitted(GgufqError):
    """The API key may not do this (it needs an admin key, or asks past its ceilings)."""

    code = "permission_denied"


class BadOrigin(GgufqError):
    """The request came by a name or from a page this gateway does not trust."""

    code = "forbidden_origin"


class RequestTooLarge(GgufqError):
    """The request body is over the gateway's limit."""

    code = "request_too_large"


class UnsupportedMediaType(GgufqError):
    """The request body is not sent as JSON."""

    code = "unsupported_media_type"


class NotSupported(GgufqError):
    """An Ollama or OpenAI feature this gateway does not serve."""

    code = "not_supported"


class ModelLoading(GgufqError):
    """A request that does not stream waited past GGUFQ_HTTP_LOAD_WAIT_S for its model's
    load (503 with Retry-After; the load goes on, and a retry finds the model loaded)."""

    code = "model_loading"

    def __init__(self, progress: LoadProgress, waited_s: float) -> None:
        done = f"{progress.fraction:.0%}" if progress.stage == "loading" else progress.stage
        super().__init__(
            f"model {progress.model!r} is still loading ({done}) after {waited_s:g} s; its "
            f"load goes on: retry in {progress.retry_after_s()} s, or stream the request to "
            "wait with its progress (GGUFQ_HTTP_LOAD_WAIT_S sets this wait)"
        )
        self.progress = progress
        self.retry_after_s = progress.retry_after_s()


@dataclass(frozen=True)
class HttpError:
    status: int
    retry_after_s: int | None = None


_STATUS: list[tuple[type[GgufqError], HttpError]] = [
    (InvalidRequest, HttpError(400)),
    (ModelNotFound, HttpError(404)),
    (JobNotFound, HttpError(404)),
    (NotFound, HttpError(404)),
    (Conflict, HttpError(409)),
    (Unauthorized, HttpError(401)),
    (Forbidden, HttpError(403)),
    (BadOrigin, HttpError(403)),
    (NotPermitted, HttpError(403)),
    (RequestTooLarge, HttpError(413)),
    (UnsupportedMediaType, HttpError(415)),
    (NotSupported, HttpError(501)),
    (ServerBusy, HttpError(503, RETRY_AFTER_S)),
    (NoCapacity, HttpError(503, RETRY_AFTER_S)),
    (NoWorkers, HttpError(503, RETRY_AFTER_S)),
    (StackNotRunning, HttpError(503, RETRY_AFTER_S)),
    (RedisUnavailable, HttpError(503, RETRY_AFTER_S)),
    (JobTimeout, HttpError(504)),
    (InvalidModelFile, HttpError(500)),
    (LoadFailed, HttpError(500)),
    (JobFailed, HttpError(500)),
    (ChunksLost, HttpError(500)),
    (JobCancelled, HttpError(500)),
]

_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    501: "invalid_request_error",
}


def http_error(exc: GgufqError) -> HttpError:
    """The status (and Retry-After) for an error."""
    if isinstance(exc, RateLimited):
        return HttpError(429, exc.retry_after_s)
    if isinstance(exc, ModelLoading):
        return HttpError(503, exc.retry_after_s)
    for cls, answer in _STATUS:
        if isinstance(exc, cls):
            return answer
    return HttpError(500)


def headers_for(answer: HttpError) -> dict[str, str]:
    return {} if answer.retry_after_s is None else {"Retry-After": str(answer.retry_after_s)}


# an absolute path in a message (after a space, a quote or a parenthesis): the server's
# files are nobody's business over HTTP
_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s'\"():;,/]+/)*([^\s'\"():;,/]*)")


def public(message: str) -> str:
    """``message`` fit to send to a client: absolute paths cut to their last part
    ("/srv/models/tiny.gguf" is "tiny.gguf", "/srv/models" is "models")."""
    return _PATH.sub(lambda m: m.group(1) or "/", message)


def ollama_body(exc: GgufqError) -> dict[str, object]:
    return {"error": public(str(exc)), **_progress(exc)}


def openai_body(exc: GgufqError, status: int) -> dict[str, dict[str, object]]:
    kind = _OPENAI_TYPE.get(status, "server_error")
    message = public(str(exc))
    error = {"message": message, "type": kind, "param": None, "code": exc.code}
    return {"error": {**error, **_progress(exc)}}


def _progress(exc: GgufqError) -> dict[str, object]:
    return {"load_progress": exc.progress.body()} if isinstance(exc, ModelLoading) else {}

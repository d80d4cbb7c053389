"""What a batch line's request body becomes: the job it runs as (the same job the endpoint
would submit), and the response body its final record makes (the endpoint's own)."""

from __future__ import annotations

import logging
from typing import Any

from api_client.gateway.core import model_name
from api_client.gateway.errors import http_error, openai_body
from api_client.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_completion,
    embedding_list,
    text_completion,
)
from scheduler.errors import GgufqError
from scheduler.protocol import EmbedResponse, GenerateResponse

log = logging.getLogger(__name__)

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


def job_of(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``AsyncClient.submit`` for one line (its tenant, priority,
    id and time are the driver's to add)."""
    if endpoint == CHAT:
        chat = ChatCompletionRequest.model_validate(body)
        extra = {"kind": "chat", "messages": chat.turns(), **chat.tool_fields()}
        return {
            "model": model_name(chat.model),
            "options": chat.options(),
            "format": chat.job_format(),
            "extra": {**extra, **chat.think_fields()},
        }
    if endpoint == COMPLETIONS:
        completion = CompletionRequest.model_validate(body)
        return {
            "model": model_name(completion.model),
            "prompt": completion.text(),
            "options": completion.options(),
            "extra": {"kind": "generate"},
        }
    embedding = EmbeddingRequest.model_validate(body)
    return {
        "model": model_name(embedding.model),
        "extra": {"kind": "embed", "input": embedding.texts(), "truncate": False},
    }


def answer_of(endpoint: str, body: dict[str, Any], job_id: str, final: dict[str, Any]) -> Any:
    """The response body of the line's endpoint, from its job's final record."""
    if endpoint == EMBEDDINGS:
        embedding = EmbeddingRequest.model_validate(body)
        return embedding_list(embedding, EmbedResponse.model_validate(final))
    record = GenerateResponse.model_validate(final)
    model = str(body.get("model", ""))
    if endpoint == CHAT:
        return chat_completion(job_id, model, [record])
    return text_completion(job_id, model, [record])


def line_error(exc: Exception, job_id: str) -> tuple[int, dict[str, Any]]:
    """A line's error line (status, OpenAI's error body): its job's error, or, for anything
    else (a final record this gateway cannot read), a 500 that says what happened, so that
    the line ends instead of stopping every driver that takes the batch up."""
    if not isinstance(exc, GgufqError):
        log.error("job %s: its answer could not be made", job_id, exc_info=exc)
        exc = GgufqError(
            f"job {job_id}'s answer could not be made ({type(exc).__name__}: {exc}); "
            "see the gateway's log, and report it if it persists"
        )
    status = http_error(exc).status
    return status, openai_body(exc, status)

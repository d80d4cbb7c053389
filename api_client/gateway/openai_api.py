"""OpenAI's API on the cluster, under /v1: chat/completions, completions, embeddings, models.

Streams are server-sent events: one ``data:`` line per chunk, ``data: [DONE]`` at the end,
an SSE comment (``: keep-alive``) every few seconds while a job waits, and an ``error`` event
if the job fails after the stream began. A completion's prompt is raw text; a chat is
rendered with the model's own chat template.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from api_client.ajob import AsyncJob
from api_client.gateway.catalog import openai_model, usable
from api_client.gateway.core import (
    Gateway,
    Routes,
    caller_of,
    gateway_of,
    json_body,
    model_name,
    parse_body,
)
from api_client.gateway.ollama_schema import shorten
from api_client.gateway.openai_schema import (
    DONE,
    KEEPALIVE,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    answer_message,
    calls_of,
    envelope,
    error_event,
    event,
    finish_reason,
    usage,
    vector,
)
from api_client.gateway.responses_schema import ResponsesRequest, ResponseStream, response_object
from scheduler.errors import ModelNotFound
from scheduler.protocol import GenerateResponse

SSE = "text/event-stream"

router = Routes(prefix="/v1")


@router.add("/chat/completions", "POST")
async def chat_completions(request: Request) -> Any:
    gateway, caller = gateway_of(request), caller_of(request)
    body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await json_body(request))
    job = await gateway.submit(
        caller,
        model_name(body.model),
        kind="chat",
        options=body.options(),
        format=body.job_format(),
        extra={"messages": body.turns(), **body.tool_fields(), **body.think_fields()},
    )
    if body.stream:
        return await _stream(gateway, job, body.model, "chat.completion.chunk", body)
    final = await gateway.result(request, job)
    return {
        **envelope("chat.completion", job.id, body.model, final.created_at),
        "choices": [
            {
                "index": 0,
                "message": answer_message(final),
                "logprobs": None,
                "finish_reason": finish_reason(final),
            }
        ],
        "usage": usage(final),
    }


@router.add("/completions", "POST")
async def completions(request: Request) -> Any:
    gateway, caller = gateway_of(request), caller_of(request)
    body: CompletionRequest = parse_body(CompletionRequest, await json_body(request))
    job = await gateway.submit(
        caller, model_name(body.model), prompt=body.text(), options=body.options()
    )
    if body.stream:
        return await _stream(gateway, job, body.model, "text_completion", body)
    final = await gateway.result(request, job)
    return {
        **envelope("text_completion", job.id, body.model, final.created_at),
        "choices": [
            {
                "text": final.response,
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason(final),
            }
        ],
        "usage": usage(final),
    }


async def _stream(
    gateway: Gateway,
    job: AsyncJob,
    model: str,
    kind: str,
    body: ChatCompletionRequest | CompletionRequest,
) -> Response:
    chat = kind.startswith("chat")
    with_usage = body.include_usage()
    head = envelope(kind, job.id, model, time.time())
    first = [True]

    def choice(
        text: str | None,
        reason: str | None,
        calls: list[dict[str, Any]] | None = None,
        thought: str = "",
    ) -> dict[str, Any]:
        if not chat:
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": reason}
        delta: dict[str, Any] = {}
        if first[0]:
            delta["role"] = "assistant"
            first[0] = False
        if thought:
            delta["reasoning_content"] = thought
        if text is not None and (text or not thought):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": n, **call} for n, call in enumerate(calls)]
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def chunk(choices: list[dict[str, Any]], final: GenerateResponse | None = None) -> bytes:
        out: dict[str, Any] = {**head, "choices": choices}
        if with_usage:
            out["usage"] = usage(final) if final is not None else None
        return event(out)

    def encode(item: GenerateResponse) -> list[bytes]:
        if not item.done:
            return [chunk([choice(item.response, None, thought=item.thinking)])]
        calls = calls_of(item)  # each call whole, in one delta before the finish
        frames = [chunk([choice(None, None, calls)])] if calls else []
        frames.append(chunk([choice(None, finish_reason(item))]))
        if with_usage:
            frames.append(chunk([], item))
        return [*frames, DONE]

    return gateway.stream(job, encode, error_event, KEEPALIVE, SSE)


@router.add("/responses", "POST")
async def responses(request: Request) -> Any:
    """OpenAI's Responses API, stateless (api_client/gateway/responses_schema.py)."""
    gateway, caller = gateway_of(request), caller_of(request)
    body: ResponsesRequest = parse_body(ResponsesRequest, await json_body(request))
    job = await gateway.submit(
        caller,
        model_name(body.model),
        kind="chat",
        options=body.options(),
        format=body.job_format(),
        extra=body.job_fields(),
    )
    if body.stream:
        events = ResponseStream(job.id, body)
        return gateway.stream(job, events.encode, events.error, KEEPALIVE, SSE)
    final = await gateway.result(request, job)
    return response_object(job.id, body, final, final.created_at)


@router.add("/embeddings", "POST")
async def embeddings(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    body: EmbeddingRequest = parse_body(EmbeddingRequest, await json_body(request))
    result = await gateway.embed(
        request, caller, model_name(body.model), body.texts(), truncate=False
    )
    vectors = shorten(result.embeddings, body.dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": vector(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = result.prompt_eval_count
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.add("/models", "GET")
async def models(request: Request) -> dict[str, Any]:
    entries, caller = (
        await asyncio.to_thread(usable, gateway_of(request).registry),
        caller_of(request),
    )
    return {"object": "list", "data": [openai_model(e) for e in entries if caller.may_use(e.name)]}


@router.add("/models/{model}", "GET")
async def model(request: Request) -> dict[str, Any]:
    model = request.path_params["model"]
    name = model_name(model)
    for entry in await asyncio.to_thread(usable, gateway_of(request).registry):
        if entry.name == name and caller_of(request).may_use(name):
            return openai_model(entry)
    raise ModelNotFound(f"model {model!r} not found; GET /v1/models lists the available ones")

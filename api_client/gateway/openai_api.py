"""OpenAI's API on the cluster, under /v1: chat/completions, completions, embeddings, models.

Streams are server-sent events: one ``data:`` line per chunk, ``data: [DONE]`` at the end,
an SSE comment (``: keep-alive``) every few seconds while a job waits, and an ``error`` event
if the job fails after the stream began. A completion's prompt is raw text; a chat is
rendered with the model's own chat template.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from api_client.ajob import AsyncJob
from api_client.gateway.caller import caller_of
from api_client.gateway.catalog import openai_model, usable
from api_client.gateway.choices import Choices, all_results, check_choices, submit_choices
from api_client.gateway.core import (
    Gateway,
    Routes,
    gateway_of,
    json_body,
    model_name,
    parse_body,
    submit_chat,
)
from api_client.gateway.openai_schema import (
    DONE,
    KEEPALIVE,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    calls_of,
    chat_completion,
    chat_logprobs,
    embedding_list,
    envelope,
    error_event,
    event,
    finish_reason,
    text_completion,
    text_logprobs,
    usage,
)
from api_client.gateway.output import sse_beat
from api_client.gateway.responses_schema import ResponsesRequest, ResponseStream, response_object
from scheduler.errors import ModelNotFound
from scheduler.protocol import GenerateResponse

SSE = "text/event-stream"

router = Routes(prefix="/v1")


@router.add("/chat/completions", "POST")
async def chat_completions(request: Request) -> Any:
    gateway, caller = gateway_of(request), caller_of(request)
    body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await json_body(request))
    options, model = body.options(), model_name(body.model)
    extra = {"messages": body.turns(), **body.tool_fields(), **body.think_fields()}
    fmt = body.job_format()

    def submit(seed: dict[str, Any]) -> Awaitable[AsyncJob]:
        return gateway.submit(
            caller, model, kind="chat", options={**options, **seed}, format=fmt, extra=extra
        )

    jobs = await submit_choices(check_choices(body.n, caller), body.seed, submit)
    if body.stream:
        return _stream(gateway, jobs, body.model, "chat.completion.chunk", body)
    finals = await all_results(jobs, lambda job: gateway.result(request, job))
    return chat_completion(jobs[0].id, body.model, finals)


@router.add("/completions", "POST")
async def completions(request: Request) -> Any:
    gateway, caller = gateway_of(request), caller_of(request)
    body: CompletionRequest = parse_body(CompletionRequest, await json_body(request))
    options, model, prompt = body.options(), model_name(body.model), body.text()

    def submit(seed: dict[str, Any]) -> Awaitable[AsyncJob]:
        return gateway.submit(caller, model, prompt=prompt, options={**options, **seed})

    jobs = await submit_choices(check_choices(body.n, caller), body.seed, submit)
    if body.stream:
        return _stream(gateway, jobs, body.model, "text_completion", body)
    finals = await all_results(jobs, lambda job: gateway.result(request, job))
    return text_completion(jobs[0].id, body.model, finals)


def _stream(
    gateway: Gateway,
    jobs: list[AsyncJob],
    model: str,
    kind: str,
    body: ChatCompletionRequest | CompletionRequest,
) -> Response:
    chat = kind.startswith("chat")
    with_usage = body.include_usage()
    job = jobs[0] if len(jobs) == 1 else Choices(jobs)
    head = envelope(kind, job.id, model, time.time())
    begun: set[int] = set()  # choices whose role went out
    finals: list[GenerateResponse] = []

    def choice(
        text: str | None,
        reason: str | None,
        calls: list[dict[str, Any]] | None = None,
        thought: str = "",
    ) -> dict[str, Any]:
        index = job.index if isinstance(job, Choices) else 0
        if not chat:
            return {"text": text or "", "index": index, "logprobs": None, "finish_reason": reason}
        delta: dict[str, Any] = {}
        if index not in begun:
            delta["role"] = "assistant"
            begun.add(index)
        if thought:
            delta["reasoning_content"] = thought
        if text is not None and (text or not thought):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": n, **call} for n, call in enumerate(calls)]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def chunk(choices: list[dict[str, Any]], last: bool = False) -> bytes:
        out: dict[str, Any] = {**head, "choices": choices}
        if with_usage:
            out["usage"] = usage(*finals) if last else None
        return event(out)

    def encode(item: GenerateResponse) -> list[bytes]:
        if not item.done:
            return [chunk([choice(item.response, None, thought=item.thinking)])]
        finals.append(item)
        calls = calls_of(item)  # each call whole, in one delta before the finish
        frames = [chunk([choice(None, None, calls)])] if calls else []
        last = choice(None, finish_reason(item))  # with every token's logprobs, if asked
        last["logprobs"] = chat_logprobs(item) if chat else text_logprobs(item)
        frames.append(chunk([last]))
        if not job.ends_with(item):
            return frames
        if with_usage:
            frames.append(chunk([], last=True))
        return [*frames, DONE]

    return gateway.stream(job, encode, error_event, sse_beat(KEEPALIVE), SSE)


@router.add("/responses", "POST")
async def responses(request: Request) -> Any:
    """OpenAI's Responses API, stateless (api_client/gateway/responses_schema.py)."""
    gateway = gateway_of(request)
    body: ResponsesRequest = parse_body(ResponsesRequest, await json_body(request))
    job = await submit_chat(request, body)
    if body.stream:
        events = ResponseStream(job.id, body)
        return gateway.stream(job, events.encode, events.error, sse_beat(KEEPALIVE), SSE)
    final = await gateway.result(request, job)
    return response_object(job.id, body, final, final.created_at)


@router.add("/embeddings", "POST")
async def embeddings(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    body: EmbeddingRequest = parse_body(EmbeddingRequest, await json_body(request))
    result = await gateway.embed(
        request, caller, model_name(body.model), body.texts(), truncate=False
    )
    return embedding_list(body, result)


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

"""Anthropic's Messages API on the cluster: ``POST /v1/messages``, whole or streamed as
Anthropic's server-sent events (``ping`` events while a job waits, an ``error`` event if
the job fails after the stream began). The key may come as ``x-api-key`` (as Anthropic's
clients send it) or as a bearer token."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from api_client.gateway.anthropic_schema import (
    KEEPALIVE,
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    error_event,
    message_object,
)
from api_client.gateway.caller import caller_of
from api_client.gateway.core import (
    Routes,
    gateway_of,
    json_body,
    model_name,
    parse_body,
    submit_chat,
)
from api_client.gateway.output import sse_beat
from scheduler.chat import chat_text
from scheduler.protocol import parse_request

router = Routes(prefix="/v1")


@router.add("/messages", "POST")
async def messages(request: Request) -> Any:
    gateway = gateway_of(request)
    body: MessagesRequest = parse_body(MessagesRequest, await json_body(request))
    job = await submit_chat(request, body)
    if body.stream:
        events = MessageStream(job.id, body.model)
        return gateway.stream(
            job, events.encode, error_event, sse_beat(KEEPALIVE), "text/event-stream"
        )
    return message_object(job.id, body.model, await gateway.result(request, job))


@router.add("/messages/count_tokens", "POST")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens, as the model's template renders the request and its vocabulary
    tokenizes it (the model's file must be on the gateway's host, as /api/show needs)."""
    gateway, caller = gateway_of(request), caller_of(request)
    body: CountTokensRequest = parse_body(CountTokensRequest, await json_body(request))
    model = model_name(body.model)
    caller.check_model(model)
    job = parse_request({"kind": "chat", "model": model, **body.job_fields()})
    path = str(gateway.registry.resolve(model))
    info = gateway.registry.info(model)
    template = (info.chat_template, info.bos_text, info.eos_text)
    text = await asyncio.to_thread(chat_text, job, *template)
    return {"input_tokens": await asyncio.to_thread(gateway.vocabularies.count, path, text)}

"""Ollama's API on the cluster: /api/generate, /api/chat, /api/embed, /api/embeddings,
/api/tags, /api/ps, /api/show, /api/version, and / ("Ollama is running").

Streams are NDJSON, one record per line, the last with ``done: true`` and the stats; while a
job waits (parked, or its model loading) an empty record goes out every few seconds, which
every client concatenates as nothing (a blank line would break ollama-python's parser).
Model files are not managed here: pull answers for a model that is there, and push, create,
copy, delete and blobs say that models come from GGUFQ_MODELS_DIR.
"""

from __future__ import annotations

import asyncio
import functools
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Literal, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from api_client.ajob import AsyncJob
from api_client.gateway.caller import Caller, caller_of
from api_client.gateway.catalog import running, show, tag, usable
from api_client.gateway.core import (
    Gateway,
    Routes,
    gateway_of,
    json_body,
    known_options,
    model_name,
    parse_body,
)
from api_client.gateway.errors import NotSupported
from api_client.gateway.loads import LoadProgress
from api_client.gateway.ollama_schema import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
    calls_record,
    empty_record,
    error_line,
    generate_record,
    line,
    made_calls,
    shorten,
)
from scheduler.errors import ModelNotFound
from scheduler.protocol import GenerateResponse

# The Ollama release whose API this gateway speaks. Tools read /api/version's "version" as
# Ollama's and turn features off below the releases that brought them (structured outputs
# came with 0.5), so it stays Ollama's numbering; ggufq's own version is given beside it.
OLLAMA_VERSION = "0.9.6"
NDJSON = "application/x-ndjson"
Body = TypeVar("Body", GenerateRequest, ChatRequest)


@functools.cache  # the installed version does not change under a running process
def ggufq_version() -> str:
    try:
        return package_version("ggufq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


router = Routes()


@router.add("/", "GET", "HEAD")
async def root(_request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


@router.add("/api/version", "GET")
async def version(_request: Request) -> dict[str, str]:
    return {"version": OLLAMA_VERSION, "ggufq": ggufq_version()}


@router.add("/api/generate", "POST")
async def generate(request: Request) -> Response:
    gateway, caller = gateway_of(request), caller_of(request)
    body, model = await _read(request, GenerateRequest)
    if not body.prompt:
        return await _load_or_unload(request, gateway, caller, body, model, chat=False)
    kind: Literal["generate", "chat"] = "generate"
    prompt, extra = body.prompt, {}
    if not body.raw and gateway.has_chat_template(model):
        # Ollama renders a prompt with the model's template unless raw: as a one-turn chat
        turns = [{"role": "system", "content": body.system}] if body.system else []
        kind, prompt = "chat", ""
        extra = {"messages": [*turns, {"role": "user", "content": body.prompt}]}
    elif body.system and not body.raw:
        prompt = f"{body.system}\n\n{body.prompt}"
    job = await _submit(gateway, caller, body, model, kind, prompt, extra)
    return await _answer(request, gateway, job, body.model, body.stream, chat=False)


@router.add("/api/chat", "POST")
async def chat(request: Request) -> Response:
    gateway, caller = gateway_of(request), caller_of(request)
    body, model = await _read(request, ChatRequest)
    if not body.messages:
        return await _load_or_unload(request, gateway, caller, body, model, chat=True)
    extra = {"messages": body.turns(), "tools": body.tools}
    job = await _submit(gateway, caller, body, model, "chat", "", extra)
    return await _answer(request, gateway, job, body.model, body.stream, chat=True)


async def _read(request: Request, schema: type[Body]) -> tuple[Body, str]:
    """A generate or chat body, checked for what ggufq cannot honour, and its model."""
    body: Body = parse_body(schema, await json_body(request))
    body.refuse_unsupported()
    return body, model_name(body.model)


async def _submit(
    gateway: Gateway,
    caller: Caller,
    body: GenerateRequest | ChatRequest,
    model: str,
    kind: Literal["generate", "chat"],
    prompt: str,
    extra: dict[str, Any],
) -> AsyncJob:
    return await gateway.submit(
        caller,
        model,
        kind=kind,
        prompt=prompt,
        options={**known_options(body.options), **body.logprob_options()},
        keep_alive=body.keep_alive,
        format=body.job_format(),
        extra={**extra, **body.job_fields()},
    )


async def _answer(
    request: Request, gateway: Gateway, job: AsyncJob, echo: str, stream: bool, chat: bool
) -> Response:
    if not stream:
        final = await gateway.result(request, job)
        return JSONResponse(generate_record(echo, final, chat=chat))

    lines = _Lines(echo, chat)
    return gateway.stream(job, lines.encode, error_line, lines.beat, NDJSON)


class _Lines:
    """A streamed answer's NDJSON lines: its chunks, and its keep-alives (with the load's
    progress). Slots, not two closures: a gateway holds thousands of waiting answers."""

    __slots__ = ("echo", "chat")

    def __init__(self, echo: str, chat: bool) -> None:
        self.echo, self.chat = echo, chat

    def encode(self, chunk: GenerateResponse) -> list[bytes]:
        echo, chat = self.echo, self.chat
        if not chunk.done:
            return [line(generate_record(echo, chunk, chat=chat))]
        # the chunks before the last carried the text; tool calls come on a line before it,
        # as Ollama sends them
        last = line(generate_record(echo, chunk, "", chat, calls=False))
        return [line(calls_record(echo, chunk)), last] if chat and made_calls(chunk) else [last]

    def beat(self, progress: LoadProgress | None) -> bytes:
        record = empty_record(self.echo, time.time(), self.chat, None)
        return line(record if progress is None else {**record, "load_progress": progress.body()})


async def _load_or_unload(
    request: Request,
    gateway: Gateway,
    caller: Caller,
    body: GenerateRequest | ChatRequest,
    model: str,
    chat: bool,
) -> Response:
    """An empty prompt (no messages) loads the model; with keep_alive 0 it unloads it."""
    if body.unloads():
        await gateway.unload(caller, model)
        record = empty_record(body.model, time.time(), chat, "unload")
    else:
        job = await gateway.submit(
            caller, model, options=known_options(body.options), keep_alive=body.keep_alive
        )
        final = await gateway.result(request, job, load_wait=False)  # it asks for the load
        record = empty_record(body.model, final.created_at, chat, final.done_reason or "load")
    return _one(record, body.stream)


def _one(record: dict[str, Any], stream: bool) -> Response:
    if stream:
        return Response(line(record), media_type=NDJSON)
    return JSONResponse(record)


@router.add("/api/embed", "POST")
async def embed(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    body: EmbedRequest = parse_body(EmbedRequest, await json_body(request))
    model = model_name(body.model)
    texts = body.texts()
    if not texts:
        return {"model": body.model, "embeddings": []}
    result = await gateway.embed(
        request,
        caller,
        model,
        texts,
        truncate=body.truncate,
        options=known_options(body.options),
        keep_alive=body.keep_alive,
    )
    out: dict[str, Any] = {
        "model": body.model,
        "embeddings": shorten(result.embeddings, body.dimensions),
        "total_duration": result.total_duration,
        "load_duration": result.load_duration,
        "prompt_eval_count": result.prompt_eval_count,
    }
    return {k: v for k, v in out.items() if v is not None}


@router.add("/api/embeddings", "POST")
async def embeddings(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    body: EmbeddingsRequest = parse_body(EmbeddingsRequest, await json_body(request))
    model = model_name(body.model)
    if not body.prompt:
        return {"embedding": []}
    result = await gateway.embed(
        request,
        caller,
        model,
        [body.prompt],
        truncate=True,
        options=known_options(body.options),
        keep_alive=body.keep_alive,
    )
    # Ollama's legacy handler returns the model's vector as it comes (only /api/embed
    # normalizes); ggufq's embedding runners return unit vectors alone, so this one has unit
    # length: the same direction, so cosine similarities are the same, dot products not
    return {"embedding": result.embeddings[0]}


@router.add("/api/tags", "GET")
async def tags(request: Request) -> dict[str, Any]:
    registry, caller = gateway_of(request).registry, caller_of(request)
    entries = await asyncio.to_thread(usable, registry)
    return {"models": [tag(e) for e in entries if caller.may_use(e.name)]}


@router.add("/api/ps", "GET")
async def ps(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    runners, now = await gateway.client.ps(), time.time()
    return {"models": [running(r, now) for r in runners if gateway.may_see_runner(caller, r.model)]}


@router.add("/api/show", "POST")
async def show_model(request: Request) -> dict[str, Any]:
    body: ShowRequest = parse_body(ShowRequest, await json_body(request))
    model = model_name(body.model or body.name)
    caller_of(request).check_model(model)
    return await asyncio.to_thread(show, gateway_of(request).registry, model, body.verbose)


@router.add("/api/pull", "POST")
async def pull(request: Request) -> Response:
    """Tools pull before they use a model: one that is there needs no pull."""
    body = await json_body(request)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    model, caller = model_name(name), caller_of(request)
    names = [
        n for n in await asyncio.to_thread(gateway_of(request).registry.names) if caller.may_use(n)
    ]
    if model not in names:
        raise ModelNotFound(
            f"model {model!r} cannot be pulled: ggufq serves the GGUF files in "
            "GGUFQ_MODELS_DIR; download the file there and name it by its stem "
            f"(available: {', '.join(names) or 'none'})"
        )
    stream = body.get("stream", True) is not False
    return _one({"status": "success"}, stream)


@router.add("/api/push", "POST")
@router.add("/api/create", "POST")
@router.add("/api/copy", "POST")
@router.add("/api/delete", "DELETE")
@router.add("/api/blobs/{digest}", "HEAD", "POST")
async def manage_models(request: Request) -> Response:
    raise NotSupported(
        f"{request.method} {request.url.path} is not served: ggufq does not manage model "
        "files; models are the *.gguf files in GGUFQ_MODELS_DIR, named by their stem: copy, "
        "rename or delete the files there"
    )

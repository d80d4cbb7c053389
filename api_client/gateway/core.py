"""What both APIs of the gateway share: the cluster client, the caller, and jobs submitted,
streamed or awaited on the caller's behalf."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import cached_property
from typing import Any, Literal, Protocol, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from api_client.batches.files import FileStore, file_store
from api_client.batches.store import BatchStore
from api_client.gateway.caller import Caller, caller_of
from api_client.gateway.errors import ModelLoading
from api_client.gateway.loads import LoadBoard
from api_client.gateway.output import Beat
from api_client.gateway.resume import asked
from api_client.gateway.streaming import (
    Encode,
    JobStreamResponse,
    lost,
    or_cancel_on_disconnect,
)
from api_client.gateway.tokens import Vocabularies
from scheduler.errors import (
    GgufqError,
    InvalidModelFile,
    InvalidRequest,
    ModelNotFound,
    RedisUnavailable,
)
from scheduler.gguf.registry import Registry
from scheduler.names import check_model_name
from scheduler.protocol import (
    EmbedResponse,
    GenerateResponse,
    Options,
    describe_validation_error,
)
from scheduler.settings import Settings

Format = Literal["json"] | dict[str, Any] | None
Endpoint = Callable[[Request], Awaitable[Any]]
_KNOWN_OPTIONS = frozenset(Options.model_fields)
T = TypeVar("T")


class Routes:
    """Endpoints gathered by decorators into Starlette routes. Every endpoint reads its own
    body, so the gateway needs no framework above Starlette: FastAPI's layers (dependency
    solving, its router, its middlewares) cost a quarter of a millisecond on the first
    token's path. What an endpoint returns that is not a Response goes out as JSON."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.routes: list[Route] = []

    def add(self, path: str, *methods: str) -> Callable[[Endpoint], Endpoint]:
        def register(endpoint: Endpoint) -> Endpoint:
            route = Route(self.prefix + path, _answering(endpoint), methods=list(methods))
            self.routes.append(route)
            return endpoint

        return register


def _answering(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def answer(request: Request) -> Response:
        out = await endpoint(request)
        return out if isinstance(out, Response) else JSONResponse(out)

    answer.__name__ = endpoint.__name__
    return answer


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def model_name(name: str | None) -> str:
    """A model name as jobs take it: Ollama's ``:latest`` tag is dropped (ggufq's names are
    file stems, without tags)."""
    if not name:
        raise InvalidRequest('the request names no model: give \'model\', e.g. "model": "tiny"')
    if name.endswith(":latest"):
        name = name.removesuffix(":latest")
    if ":" in name:
        raise ModelNotFound(
            f"model {name!r} not found: ggufq names models by their file's stem, without a tag "
            f"(e.g. {name.split(':')[0]!r}); `ggufq models` or GET /api/tags lists them"
        )
    return check_model_name(name)


def known_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Ollama's options that ggufq serves; the others (mirostat, tfs_z, num_batch, ...) are
    dropped as Ollama drops options a runner ignores."""
    return {k: v for k, v in (options or {}).items() if k in _KNOWN_OPTIONS and v is not None}


def parse_body(model: type[Any], body: Any) -> Any:
    """A request body validated into ``model``; a pydantic error becomes a 400 that names
    the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


async def json_body(request: Request) -> Any:
    try:
        parsed = await request.json()
    except ValueError:
        raise InvalidRequest("the request body is not valid JSON") from None
    asked(request.scope, await request.body())  # a stream to be resumable keeps it
    return parsed


class ChatBody(Protocol):
    """A request body of an API that makes one chat job (Anthropic's Messages, OpenAI's
    Responses): its model, and the job's options, format and other fields."""

    model: str

    def options(self) -> dict[str, Any]: ...

    def job_format(self) -> Format: ...

    def job_fields(self) -> dict[str, Any]: ...


async def submit_chat(request: Request, body: ChatBody) -> AsyncJob:
    """The chat job of ``body``, submitted for the request's caller."""
    return await gateway_of(request).submit(
        caller_of(request),
        model_name(body.model),
        kind="chat",
        options=body.options(),
        format=body.job_format(),
        extra=body.job_fields(),
    )


class Gateway:
    """One gateway process's handle on the cluster (any number of them share one Redis)."""

    def __init__(self, client: AsyncClient, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.registry = Registry(settings.models_dir)
        self.vocabularies = Vocabularies()  # for counting tokens, loaded on first use
        # one job listing at a time (it reads every waiting job's record, in a thread):
        # a key asking for many at once waits, instead of taking every other request's
        # threads and connections
        self.listing = asyncio.Lock()
        self.loads = LoadBoard(client.ps)  # what waiting answers show of their model's load

    @cached_property
    def batches(self) -> BatchStore:
        """The Batch API's batches (made on first use, then kept)."""
        return BatchStore(self.client.r, self.settings.batch_retention_s)

    @cached_property
    def files(self) -> FileStore:
        """The Batch API's files."""
        return file_store(self.settings)

    def has_chat_template(self, model: str) -> bool:
        """Whether the model renders prompts with a chat template. A model this host cannot
        read (its file lives only on the workers' hosts) is assumed to have one: the worker
        renders, or warns."""
        try:
            return self.registry.info(model).has_chat_template
        except (ModelNotFound, InvalidModelFile):
            return True

    async def submit(
        self,
        caller: Caller,
        model: str,
        *,
        kind: Literal["generate", "chat", "embed"] = "generate",
        prompt: str = "",
        options: dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        format: Format = None,
        extra: dict[str, Any] | None = None,
    ) -> AsyncJob:
        caller.check_model(model)
        caller.check_job(options or {}, keep_alive, self.settings)
        name = self.registry.first_name(model)  # names of one file share its runners
        job = {"kind": kind, "tenant": caller.tenant, "weight": caller.weight, **(extra or {})}
        fields: dict[str, Any] = {
            "options": options,
            "keep_alive": keep_alive,
            "format": format,
            "extra": job,
        }
        if caller.resume is not None:  # GET /v1/stream/{id}: the job it made, not a new one
            return caller.resume.attach(self.client, name, prompt, **fields)
        return await self.client.submit(name, prompt, **fields)

    def stream(
        self,
        job: AsyncJob,
        encode: Encode,
        encode_error: Callable[[GgufqError], bytes],
        beat: Beat,
        media_type: str,
    ) -> Response:
        """A streamed answer. An error before the first chunk is raised (it becomes the
        status); one after is sent in-stream by ``encode_error``."""
        settings = self.settings
        return JobStreamResponse(
            job,
            encode,
            encode_error,
            beat,
            settings.http_keepalive_s,
            settings.http_timeout_s,
            media_type=media_type,
            headers=_NO_BUFFERING,
            job_header=JOB_HEADER,
            loads=self.loads,
        )

    async def result(
        self, request: Request, job: AsyncJob, load_wait: bool = True
    ) -> GenerateResponse:
        """The final record, awaited; a client that leaves first cancels the job. With
        ``load_wait``, a job still waiting for its model's load after http_load_wait_s is
        cancelled, and answered by a 503 with the load's progress."""
        work = job.result(self.settings.http_timeout_s)
        if load_wait:
            work = self._within_load_wait(work, job)
        try:
            final: GenerateResponse = await or_cancel_on_disconnect(request, work, job)
        except RedisUnavailable as exc:
            job.cancel_once_back()  # the client is told to retry: this one must not run too
            raise lost(job.id, "result", exc) from None
        return final

    async def embed(
        self,
        request: Request,
        caller: Caller,
        model: str,
        texts: list[str],
        *,
        truncate: bool,
        options: dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
    ) -> EmbedResponse:
        job = await self.submit(
            caller,
            model,
            kind="embed",
            options=options,
            keep_alive=keep_alive,
            extra={"input": texts, "truncate": truncate},
        )
        try:
            work = self._within_load_wait(job.final(self.settings.http_timeout_s), job)
            record = await or_cancel_on_disconnect(request, work, job)
        except RedisUnavailable as exc:
            job.cancel_once_back()
            raise lost(job.id, "result", exc) from None
        return EmbedResponse.model_validate(record)

    async def _within_load_wait(self, work: Awaitable[T], job: AsyncJob) -> T:
        """``work``'s answer, unless the job still waits for its model's load after
        http_load_wait_s: then the job is cancelled and ModelLoading raised. Only a load
        under way counts (its weights being read, or its context made: the job that began
        it has its worker, and the load goes on without it), as a fresh read says (no
        runner of the model ready: the job cannot have started)."""
        task = asyncio.ensure_future(work)
        wait_s = self.settings.http_load_wait_s
        try:
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            while not done:
                loading = await self.loads.now(job.model)
                if loading is not None and loading.stage != "waiting" and not task.done():
                    await job.cancel()
                    raise ModelLoading(loading, wait_s)
                done, _ = await asyncio.wait({task}, timeout=LoadBoard.LOOK_S)
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def unload(self, caller: Caller, model: str) -> None:
        caller.check_model(model)
        caller.check_admin(f"unload model {model!r}")
        if self.registry.names():  # a host without the models answers for none of them
            self.registry.resolve(model)
        await self.client.unload(self.registry.first_name(model))  # its runners' name

    def may_see_runner(self, caller: Caller, model: str) -> bool:
        """Whether a listing of runners shows one of ``model`` (a first name) to the caller:
        one of its key's models is that name, or another name of its file."""
        if caller.may_use(model):
            return True
        return caller.key is not None and any(
            self.registry.first_name(name) == model for name in caller.key.models
        )


JOB_HEADER = "X-Ggufq-Job"  # the job's id, for `ggufq cancel`, logs and Flower
# nginx and similar proxies buffer responses unless told not to: a stream must flow
_NO_BUFFERING = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}

"""The gateway's ASGI app: Ollama's API at /api and /, OpenAI's at /v1, metrics at /metrics.

Stateless: it holds an AsyncClient of the cluster and nothing else, so any number of
gateway processes on any hosts serve one Redis. One ASGI layer (:class:`Guard`) checks API
keys and their limits, and counts every request for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from api_client.aio import AsyncClient
from api_client.batches.runners import BatchRunners
from api_client.gateway import (
    anthropic_api,
    batches_api,
    jobs_api,
    ollama,
    openai_api,
    pool_api,
    stream_api,
)
from api_client.gateway.anthropic_schema import error_body as anthropic_error
from api_client.gateway.caller import Caller
from api_client.gateway.core import Gateway
from api_client.gateway.edge import EdgeRules, split_list, too_large
from api_client.gateway.errors import headers_for, http_error, ollama_body, openai_body
from api_client.gateway.keys import (
    GATEWAY_BEAT_S,
    ApiKey,
    KeyStore,
    Limiter,
    bearer_token,
)
from api_client.gateway.metrics import GatewayMetrics
from scheduler.errors import GgufqError
from scheduler.loops import stop_task
from scheduler.settings import Settings
from scheduler.store.acl import Role
from scheduler.store.connection import resolve_redis_url

log = logging.getLogger("ggufq.gateway")
# answered without a key (the pool page holds no data: what it reads asks for one)
_OPEN_PATHS = frozenset({"/", "/api/version", "/metrics", "/ui"})


def unexpected_error(path: str, exc: Exception) -> GgufqError:
    """What a client is told of an error the gateway did not expect (it is logged)."""
    return GgufqError(
        f"the gateway failed on {path} ({type(exc).__name__}: {exc}); see its log, and "
        "report it if it persists"
    )


def error_response(path: str, exc: GgufqError) -> Response:
    """The error in the shape of the API the path belongs to."""
    answer = http_error(exc)
    body: Any
    if path.startswith("/v1/messages"):
        body = anthropic_error(exc, answer.status)
    elif path.startswith("/v1/"):
        body = openai_body(exc, answer.status)
    else:
        body = ollama_body(exc)
    return JSONResponse(body, status_code=answer.status, headers=headers_for(answer))


def edge_rules(settings: Settings, require_keys: bool) -> EdgeRules:
    """The edge checks of a gateway: a keyless one answers this machine's names only."""
    return EdgeRules(
        check_host=not require_keys,
        hosts=split_list(settings.http_hosts),
        origins=split_list(settings.http_origins),
        max_body_bytes=settings.http_max_body_bytes,
        max_upload_bytes=settings.batch_max_file_bytes,
    )


def _cors(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]


def _preflight(asked: bytes) -> Response:
    """The answer to a browser's question before a cross-origin call (its Origin allowed:
    the Guard adds it to the answer): the headers ``asked`` for are allowed."""
    headers = {
        "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
        "Access-Control-Allow-Headers": asked.decode("latin-1") or "Content-Type",
        "Access-Control-Max-Age": "600",
    }
    return Response(status_code=204, headers=headers)


class _Limited:
    """``receive`` that stops a body at ``limit`` bytes: what is past it is never read.
    An object with slots, not a closure: a gateway holds thousands of waiting requests."""

    __slots__ = ("receive", "limit", "seen")

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive, self.limit, self.seen = receive, limit, 0

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                raise too_large(self.limit)
        return message


class _Counted:
    """A request's ``send`` as the Guard sees it: the response's status, when its first
    body part went (from ``started``, perf_counter), and the CORS headers an allowed
    ``origin`` adds to its head. Slots, not a closure over a dict (thousands wait)."""

    __slots__ = ("send", "origin", "started", "status", "ttfb", "begun")

    def __init__(self, send: Send, origin: bytes | None, started: float) -> None:
        self.send, self.origin, self.started = send, origin, started
        self.status, self.begun = 500, False
        self.ttfb: float | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.begun = message["status"], True
            if self.origin is not None:
                message["headers"] = [*message.get("headers", []), *_cors(self.origin)]
        elif message["type"] == "http.response.body" and self.ttfb is None:
            self.ttfb = time.perf_counter() - self.started
        await self.send(message)


class Guard:
    """The edge checks (Host, Origin, JSON bodies and their size), API keys and their
    limits, and the metrics of every request, around the app.

    A request for one of ``routes`` without path parameters goes straight to its endpoint
    from here: Starlette's router, route and exception layers would stay on the stack of
    every waiting request (about 4 KB each, and a gateway holds thousands), and they add
    nothing to an endpoint that answers its own errors (a GgufqError is answered here, and
    anything else is logged and answered here too). It is the app the server runs, around
    Starlette's (routes with path parameters, lifespan): Starlette's own outer layers would
    stay on every waiting request's stack as well."""

    def __init__(
        self,
        app: Starlette,
        gateway: Gateway,
        require_keys: bool,
        metrics: GatewayMetrics,
        rules: EdgeRules,
        limiter: Limiter | None,
        routes: list[Route] | None = None,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.require_keys = require_keys
        self.metrics = metrics
        self.rules = rules
        self.limiter = limiter
        self.direct = {
            (method, route.path): route
            for route in routes or []
            if "{" not in route.path
            for method in route.methods or ()
        }

    @property
    def state(self) -> State:
        """The Starlette app's state (``state.gateway``)."""
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.time()  # for Server-Timing
        headers = dict(scope["headers"])
        refusal = self.rules.refusal(scope["method"], headers, scope["path"])
        origin = headers.get(b"origin") if refusal is None else None  # allowed: CORS headers
        counted = _Counted(send, origin, time.perf_counter())
        key: ApiKey | None = None
        ticket: str | None = None
        try:
            if refusal is not None:
                raise refusal
            if origin is not None and scope["method"] == "OPTIONS":
                asked = headers.get(b"access-control-request-headers", b"")
                await _preflight(asked)(scope, receive, counted)
                return
            limit = self.rules.body_limit(scope["path"])
            unlimited, receive = receive, _Limited(receive, limit)
            if self.require_keys and scope["path"] not in _OPEN_PATHS:
                key, ticket = await self._admit(headers)
            del headers  # not held while the answer waits (thousands of them)
            scope.setdefault("state", {})["caller"] = Caller(key)
            route = self.direct.get((scope["method"], scope["path"]))
            if route is None:
                await self.app(scope, receive, counted)
            else:
                scope["route"] = route  # as the router would: the metrics' label
                scope["app"] = self.app  # as Starlette would: request.app.state
                response = await route.endpoint(Request(scope, receive, counted))
                # the body is read: the answer (which may wait long) needs no limit on it
                await response(scope, unlimited, counted)
        except Exception as exc:
            await _answer_error(scope, receive, counted, exc, counted.begun)
        finally:
            if ticket is not None and key is not None and self.limiter is not None:
                await asyncio.to_thread(self.limiter.done, key, ticket)
            route = scope.get("route")
            label = getattr(route, "path", "other")
            self.metrics.observe(label, counted.status, key.id if key else "", counted.ttfb)

    async def _admit(self, headers: dict[bytes, bytes]) -> tuple[ApiKey, str | None]:
        token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        token = token or headers.get(b"x-api-key", b"").decode("latin-1").strip()
        r, limiter = self.gateway.client.sync.r, self.limiter
        assert limiter is not None  # made where keys are required
        store = KeyStore(r, self.gateway.settings.http_key_secret)

        def admit() -> tuple[ApiKey, str | None]:
            key = store.lookup(token)
            return key, limiter.admit(key, time.time())

        return await asyncio.to_thread(admit)


async def _answer_error(
    scope: Scope, receive: Receive, send: Send, exc: Exception, started: bool
) -> None:
    """Answer a request that failed with its error's status, in its API's shape (one not a
    GgufqError is logged, and answered without being raised again: Starlette's outer
    handler raised it again, and the server then closed the connection); re-raised once
    its answer had begun (too late for a status: the server closes the connection)."""
    if started:
        raise exc
    if not isinstance(exc, GgufqError):
        log.exception("%s %s failed", scope["method"], scope["path"], exc_info=exc)
        exc = unexpected_error(scope["path"], exc)
    await error_response(scope["path"], exc)(scope, receive, send)


async def _beat(limiter: Limiter, cluster: AsyncClient) -> None:
    """Say this gateway process is alive, so that its requests in flight count against
    their keys' limits (and stop counting soon after it dies): on the client's own side
    connection, never behind its requests' pool."""
    while True:
        await asyncio.sleep(GATEWAY_BEAT_S)
        try:
            await _beat_once(limiter, cluster)
        except Exception as exc:  # Redis away: the next beat tries again
            log.warning("the gateway's beat failed: %s", exc)


async def _beat_once(limiter: Limiter, cluster: AsyncClient) -> None:
    await limiter.beat(cluster.side)


def make_app(
    settings: Settings, client: AsyncClient | None = None, *, require_keys: bool = False
) -> Guard:
    """The gateway app (its Starlette app inside the edge checks; ``.state.gateway``).
    ``client`` defaults to one made (and closed) with the app's life."""
    own = client is None
    cluster = client or AsyncClient(
        resolve_redis_url(settings, Role.GATEWAY),  # the stack's gateway user, if it has one
        settings=settings.model_copy(update={"reader_lease_s": settings.http_reader_lease_s}),
        timeout=settings.http_timeout_s,
        max_connections=settings.http_redis_connections,
    )
    gateway = Gateway(cluster, settings)
    counters = GatewayMetrics()
    limiter = Limiter(cluster.sync.r) if require_keys else None

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        beating = None
        if limiter is not None:
            with contextlib.suppress(Exception):  # alive before the first request is admitted
                await _beat_once(limiter, cluster)
            beating = asyncio.create_task(_beat(limiter, cluster))
        parts = (gateway.batches, gateway.files, gateway.registry)  # the gateway's own
        runners = BatchRunners(cluster, settings, *parts) if settings.batch_drivers else None
        looking = asyncio.create_task(runners.run()) if runners else None
        yield
        await stop_task(looking)
        if runners is not None:
            await runners.close()
        await stop_task(beating)
        await gateway.loads.close()
        gateway.vocabularies.close()
        if own:
            await cluster.close()

    async def metrics(_request: Request) -> Response:
        return counters.response()

    async def ggufq_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GgufqError)
        return error_response(request.url.path, exc)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, unexpected_error(request.url.path, exc))

    routes = [
        *ollama.router.routes,
        *jobs_api.router.routes,
        *anthropic_api.router.routes,
        *openai_api.router.routes,
        *batches_api.router.routes,
        *pool_api.router.routes,
        *stream_api.router.routes,
        Route("/metrics", metrics),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={GgufqError: ggufq_error, Exception: unexpected},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    rules = edge_rules(settings, require_keys)
    return Guard(app, gateway, require_keys, counters, rules, limiter, routes)

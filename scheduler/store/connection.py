"""Connecting to Redis: where this host's local stack keeps its URL (so that every command
finds it), and clients that fail fast on a half-open connection."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from scheduler.errors import RedisUnavailable, StackNotRunning
from scheduler.settings import Settings
from scheduler.store import sentinel
from scheduler.store.acl import Role

# errors that mean Redis is away (down, restarting, loading its data, unreachable), not
# that a command is wrong: what waits for Redis tries again on these
REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError)
T = TypeVar("T")


def again_if_lost(do: Callable[[], T], tries: int = 2) -> T:
    """``do()``, a Redis call that does the same when made twice (a claim by token, a
    script that checks what it already did), made again at once when its reply does not
    come: the call may have run all the same, and only asking again tells. This project's
    clients never resend a command themselves (a pool's connections retry 0 times). The
    last error is raised: Redis is away, and the caller's own way of waiting takes over."""
    for _ in range(tries - 1):
        try:
            return do()
        except REDIS_AWAY:
            pass
    return do()


def ride_out(ping: Callable[[], object], budget_s: float, lost: Exception) -> None:
    """Return once ``ping()`` answers (Redis back), asking 0.1 to 0.5 s apart; raise
    ``lost`` when it has not within ``budget_s`` (a streaming reader's lease)."""
    started = time.monotonic()
    while (away := time.monotonic() - started) < budget_s:
        time.sleep(min(0.5, 0.1 + away / 4))
        try:
            ping()
            return
        except REDIS_AWAY:
            continue
    raise lost


async def aride_out(
    ping: Callable[[], Awaitable[object]], budget_s: float, lost: Exception
) -> None:
    """:func:`ride_out` for asyncio."""
    started = time.monotonic()
    while (away := time.monotonic() - started) < budget_s:
        await asyncio.sleep(min(0.5, 0.1 + away / 4))
        try:
            await ping()
            return
        except REDIS_AWAY:
            continue
    raise lost


def runtime_file(settings: Settings) -> Path:
    return Path(settings.state_dir).expanduser() / "stack.json"


def write_runtime(
    settings: Settings, redis_url: str, role_urls: dict[Role, str] | None = None
) -> None:
    """Where the local stack's Redis is, for every command of this host's user: readable by
    that user only (the URLs hold Redis passwords): the administrator's, and each role's."""
    path = runtime_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    roles = {role.value: url for role, url in (role_urls or {}).items()}
    write_private(path, json.dumps({"redis_url": redis_url, "roles": roles, "pid": os.getpid()}))


def write_private(path: Path, text: str) -> None:
    """Write ``path`` readable by this user only (it holds passwords or their digests)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file kept its mode
    with os.fdopen(fd, "w") as f:
        f.write(text)


def clear_runtime(settings: Settings) -> None:
    path = runtime_file(settings)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def resolve_redis_url(settings: Settings, role: Role | None = None) -> str:
    """GGUFQ_REDIS_URL if set, else the Redis of the local stack started by `ggufq up`: as
    ``role``'s Redis user (scheduler/store/acl.py), or the administrator when None."""
    if settings.redis_url:
        return settings.redis_url
    path = runtime_file(settings)
    try:
        record = json.loads(path.read_text())
        os.kill(int(record["pid"]), 0)
        url = (record.get("roles") or {}).get(role.value) if role is not None else None
        return str(url or record["redis_url"])
    except (OSError, ValueError, KeyError, TypeError):
        raise StackNotRunning(
            "no ggufq stack is running on this host and GGUFQ_REDIS_URL is not set; start one "
            "with `ggufq up` (or point GGUFQ_REDIS_URL at the Redis of a running stack)"
        ) from None


# Fail fast on a half-open connection (a Redis host that vanished without closing it):
# without timeouts a read waits for the kernel's TCP timeout, minutes, and a heartbeat or
# placement stalls that long. Pub/sub reads wait with their own timeouts, under these.
CLIENT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 5,
    "socket_timeout": 30,
    "socket_keepalive": True,
    "health_check_interval": 15,
    # redis-py 8 caps a pool at 100 connections and raises past that: a client with more
    # jobs streaming at once (each waits on a pub/sub connection of its own) failed
    "max_connections": 1024,
}


class RedisUnreachable(RedisUnavailable, redis.ConnectionError):
    """Redis cannot be reached: a typed error for the caller (:class:`RedisUnavailable`)
    that what waits for Redis still takes for a lost connection (:data:`REDIS_AWAY`)."""


def unreachable(where: str, exc: redis.RedisError) -> RedisUnreachable:
    """The error of a connection to ``where`` that failed with ``exc``: the cause and the
    fix in one line, instead of redis-py's traceback."""
    if isinstance(exc, redis.AuthenticationError):
        return RedisUnreachable(
            f"Redis at {where} refused the connection's credentials ({exc}); put the right user "
            "and password in GGUFQ_REDIS_URL (redis://USER:PASSWORD@HOST:PORT/0)"
        )
    cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
    why = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    return RedisUnreachable(
        f"cannot reach Redis at {where} ({why}); start the local stack with `ggufq up`, or set "
        "GGUFQ_REDIS_URL to the Redis of a running stack"
    )


def _where(connection: Any) -> str:
    path = getattr(connection, "path", "")
    return f"unix://{path}" if path else f"{connection.host}:{connection.port}"


def _typed(exc: redis.RedisError) -> bool:
    """Whether a failed connect is told as :class:`RedisUnreachable` (Redis still loading
    its data is not: it answers soon, and callers wait for it)."""
    return not isinstance(exc, (RedisUnreachable, redis.BusyLoadingError))


class _Named:
    """A connection whose failure to connect raises :class:`RedisUnreachable`."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not _typed(exc):
                raise
            raise unreachable(_where(self), exc) from exc


class _NamedAsync:
    async def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not _typed(exc):
                raise
            raise unreachable(_where(self), exc) from exc


class _Tcp(_Named, redis.Connection): ...


class _Tls(_Named, redis.SSLConnection): ...


class _Unix(_Named, redis.UnixDomainSocketConnection): ...


class _AsyncTcp(_NamedAsync, redis.asyncio.Connection): ...


class _AsyncTls(_NamedAsync, redis.asyncio.SSLConnection): ...


class _AsyncUnix(_NamedAsync, redis.asyncio.UnixDomainSocketConnection): ...


def _behind(connection: Any) -> str:
    return f"the primary {connection.connection_pool.service_name!r} its sentinels name"


class _SentinelTcp(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary the sentinels name; failing to find or reach it raises
    :class:`RedisUnreachable`, as a plain URL's connections do."""

    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[no-untyped-call]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not _typed(exc):
                raise
            raise unreachable(_behind(self), exc) from exc


class _SentinelTls(_SentinelTcp, redis.sentinel.SentinelManagedSSLConnection): ...


class _AsyncSentinelTcp(redis.asyncio.sentinel.SentinelManagedConnection):
    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[no-untyped-call]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not _typed(exc):
                raise
            raise unreachable(_behind(self), exc) from exc


class _AsyncSentinelTls(_AsyncSentinelTcp, redis.asyncio.sentinel.SentinelManagedSSLConnection): ...


def _behind_sentinels(redis_url: str, classes: tuple[type, type]) -> type:
    """The connection class of a ``redis+sentinel://`` URL's primary: TLS's for
    ``rediss+sentinel://``."""
    return classes[sentinel.parse(redis_url).tls is not None]


def _options(
    redis_url: str, classes: tuple[type, type, type], max_connections: int | None
) -> dict[str, Any]:
    scheme = redis_url.split("://", 1)[0].lower()
    kind = {"rediss": 1, "unix": 2}.get(scheme, 0)
    options = {**CLIENT_OPTIONS, "connection_class": classes[kind]}
    if max_connections is not None:  # a command waits for one of them to be free
        options.update(max_connections=max_connections, timeout=POOL_WAIT_S)
    return options


POOL_WAIT_S = 60  # the longest a command waits for a free connection of a bounded pool


def connect(redis_url: str) -> redis.Redis:
    """A Redis client for ggufq's processes, with the timeouts above. A failed connect
    raises redis-py's own errors: the services wait for Redis on those (:data:`REDIS_AWAY`),
    and must never take one for a job's error. A ``redis+sentinel://`` URL gives a client
    of whichever primary its sentinels name (scheduler/store/sentinel.py)."""
    if sentinel.is_sentinel(redis_url):
        return sentinel.client(redis_url, CLIENT_OPTIONS)
    return redis.Redis.from_url(redis_url, **CLIENT_OPTIONS)


def connect_typed(
    redis_url: str, max_connections: int | None = None, socket_timeout: float | None = None
) -> redis.Redis:
    """:func:`connect` for callers (the Python client, the CLI, the gateway): a failed
    connect raises :class:`RedisUnreachable`, which names Redis's address, the cause and
    the fix. With ``max_connections``, the client holds at most that many connections,
    and a command waits for a free one (the gateway: connections stay few whatever the
    number of its clients); ``socket_timeout`` gives up on a reply sooner."""
    options = _options(redis_url, (_Tcp, _Tls, _Unix), max_connections)
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if sentinel.is_sentinel(redis_url):  # bounded as asked, as a plain URL's pool
        typed = _behind_sentinels(redis_url, (_SentinelTcp, _SentinelTls))
        return sentinel.client(redis_url, {**options, "connection_class": typed})
    if max_connections is None:
        return redis.Redis.from_url(redis_url, **options)
    # from_pool: the client closes the pool with itself
    return redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(redis_url, **options))


def connect_typed_async(
    redis_url: str, max_connections: int | None = None, socket_timeout: float | None = None
) -> redis.asyncio.Redis:
    """:func:`connect_typed` for asyncio; ``socket_timeout`` (s) instead of 30 s."""
    options = _options(redis_url, (_AsyncTcp, _AsyncTls, _AsyncUnix), max_connections)
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if sentinel.is_sentinel(redis_url):
        typed = _behind_sentinels(redis_url, (_AsyncSentinelTcp, _AsyncSentinelTls))
        return sentinel.async_client(redis_url, {**options, "connection_class": typed})
    if max_connections is None:
        return redis.asyncio.Redis.from_url(redis_url, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(redis_url, **options)
    return redis.asyncio.Redis.from_pool(pool)

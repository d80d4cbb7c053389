"""Redis behind Sentinel: one URL (scheduler/redis_urls.py) names the sentinels and the
primary's name (``rediss+sentinel://``: both over TLS), and every client of ggufq's
(redis-py's, asyncio's, Celery's broker and result backend) asks the sentinels where the
primary is, and asks again when a connection to it fails, so that a process follows a
failover by itself. A sentinel that does not answer is passed over at once (5 s timeouts,
no retries), as a primary's connection is.
"""

from __future__ import annotations

from typing import Any, cast

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from scheduler.redis_urls import SentinelUrl, is_sentinel, parse

__all__ = ["SentinelUrl", "async_client", "client", "is_sentinel", "parse", "sentinel_kwargs"]


def sentinel_kwargs(found: SentinelUrl, asynchronous: bool = False) -> dict[str, Any]:
    """How the sentinels are asked: a dead or unreachable one costs at most 5 s, once."""
    retry = AsyncRetry(NoBackoff(), 0) if asynchronous else Retry(NoBackoff(), 0)
    kwargs: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 5, "retry": retry}
    return {**kwargs, **_tls(found), "password": found.sentinel_password}


def _tls(found: SentinelUrl) -> dict[str, Any]:
    """redis-py's options of a connection to a sentinel or the primary: TLS, with the
    URL's options, for ``rediss+sentinel://`` (where the primary's connection class is
    TLS's)."""
    return {"ssl": True, **found.tls_options} if found.tls is not None else {}


def _primary_options(found: SentinelUrl, options: dict[str, Any]) -> dict[str, Any]:
    """The primary's connections' options: ``options`` as for a plain URL (a connection
    class given is kept: the typed ones of scheduler/store/connection.py; ``timeout``,
    a bounded pool's wait for a free connection, picks the blocking pool)."""
    own = {"db": found.db, "username": found.username, "password": found.password}
    return {**options, **own, **_tls(found)}


class _BlockingPool(redis.sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """The named primary's connections, at most ``max_connections``: a command waits up to
    ``timeout`` for a free one (the gateway: connections stay few, whatever its clients)."""


class _AsyncBlockingPool(
    redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool
):
    """:class:`_BlockingPool` for asyncio."""


def _pool(options: dict[str, Any], blocking: type, plain: type) -> dict[str, Any]:
    return {"connection_pool_class": blocking if "timeout" in options else plain}


class _Primary(redis.Redis):
    """A client of the named primary that closes its sentinels' connections with its own."""

    def close(self) -> None:
        super().close()
        for asked in self.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
            asked.close()


class _AsyncPrimary(redis.asyncio.Redis):
    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for asked in self.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
            await asked.aclose()


def client(url: str, options: dict[str, Any]) -> redis.Redis:
    """A client of the primary the sentinels name now, and after a failover, the next."""
    found = parse(url)
    manager = redis.sentinel.Sentinel(list(found.sentinels), sentinel_kwargs=sentinel_kwargs(found))
    pool = _pool(options, _BlockingPool, redis.sentinel.SentinelConnectionPool)
    primary = manager.master_for(found.master, _Primary, **pool, **_primary_options(found, options))
    return cast(redis.Redis, primary)


def async_client(url: str, options: dict[str, Any]) -> redis.asyncio.Redis:
    found = parse(url)
    manager = redis.asyncio.sentinel.Sentinel(
        list(found.sentinels), sentinel_kwargs=sentinel_kwargs(found, asynchronous=True)
    )
    pool = _pool(options, _AsyncBlockingPool, redis.asyncio.sentinel.SentinelConnectionPool)
    primary = manager.master_for(
        found.master, _AsyncPrimary, **pool, **_primary_options(found, options)
    )
    return cast(redis.asyncio.Redis, primary)

"""Redis behind Sentinel: one URL names the sentinels and the primary's name, and every
client of ggufq's (redis-py's, asyncio's, Celery's broker and result backend) asks the
sentinels where the primary is, and asks again when a connection to it fails, so that a
process follows a failover by itself.

    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/DB?master=NAME

USER and PASSWORD are the primary's (an ACL user per role, as with ``redis://``); the
sentinels themselves are asked without a password unless ``sentinel_password=`` says one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    @property
    def kombu_url(self) -> str:
        """kombu's form (Celery's broker and result backend): one ``sentinel://`` URL per
        sentinel, the primary's credentials and database on each."""
        auth = ""
        if self.password is not None:
            user = quote(self.username or "", safe="")
            auth = f"{user}:{quote(self.password, safe='')}@"
        return ";".join(
            f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels
        )

    @property
    def transport_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"master_name": self.master}
        if self.sentinel_password:
            options["sentinel_kwargs"] = {"password": self.sentinel_password}
        return options


def is_sentinel(url: str | None) -> bool:
    return bool(url) and str(url).lower().startswith(f"{SCHEME}://")


def parse(url: str) -> SentinelUrl:
    """The parts of a ``redis+sentinel://`` URL; ValueError names what is missing."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    master = (query.get("master") or [""])[0]
    if not master:
        raise ValueError("a redis+sentinel:// URL names its primary: add ?master=NAME")
    netloc = parts.netloc.rpartition("@")[2]
    sentinels = []
    for address in filter(None, netloc.split(",")):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {address!r}: give HOST:PORT (26379 by default)")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise ValueError("a redis+sentinel:// URL names at least one sentinel: HOST:PORT")
    db = parts.path.strip("/")
    return SentinelUrl(
        tuple(sentinels),
        master,
        int(db) if db.isdigit() else 0,
        unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password is not None else None,
        next(iter(query.get("sentinel_password", [])), None),
    )


def _primary_options(found: SentinelUrl, options: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in options.items() if k not in ("connection_class", "timeout")}
    out.update(db=found.db, username=found.username, password=found.password)
    return out


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
    sentinel_kwargs = {"socket_timeout": 5, "password": found.sentinel_password}
    manager = redis.sentinel.Sentinel(list(found.sentinels), sentinel_kwargs=sentinel_kwargs)
    primary = manager.master_for(found.master, _Primary, **_primary_options(found, options))
    return cast(redis.Redis, primary)


def async_client(url: str, options: dict[str, Any]) -> redis.asyncio.Redis:
    found = parse(url)
    sentinel_kwargs = {"socket_timeout": 5, "password": found.sentinel_password}
    manager = redis.asyncio.sentinel.Sentinel(
        list(found.sentinels), sentinel_kwargs=sentinel_kwargs
    )
    primary = manager.master_for(found.master, _AsyncPrimary, **_primary_options(found, options))
    return cast(redis.asyncio.Redis, primary)

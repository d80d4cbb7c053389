"""What a Redis URL of ggufq's names (pure: no connection is made): the
``redis+sentinel://`` form behind Sentinel (scheduler/store/sentinel.py), and kombu's form
of it for Celery.

    redis+sentinel://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/DB?master=NAME

USER and PASSWORD are the primary's; PORT is 26379 where not given;
``&sentinel_password=`` is the sentinels' own, if they ask for one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379


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
        hosts = [(f"[{host}]" if ":" in host else host, port) for host, port in self.sentinels]
        return ";".join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in hosts)

    def transport_options(self, sentinel_kwargs: dict[str, Any]) -> dict[str, Any]:
        """kombu's options (the broker's and the result backend's): the primary's name,
        and how to ask the sentinels."""
        kwargs = {**sentinel_kwargs, "password": self.sentinel_password}
        return {"master_name": self.master, "sentinel_kwargs": kwargs}


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
        host, colon, port = address.rpartition(":")
        if not colon or host.endswith(":") or (host.startswith("[") and not host.endswith("]")):
            host, port = address, str(SENTINEL_PORT)  # no port: a name, or a bare [v6]
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {address!r}: give HOST or HOST:PORT")
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


def masked(url: str) -> str:
    """A URL with its password as ``****``: fit to print or log."""
    parts = urlsplit(url)
    query = re.sub(r"(?<![^&])(sentinel_password=)[^&]*", r"\1****", parts.query)
    parts = parts._replace(query=query)
    if parts.password:
        hosts = parts.netloc.rpartition("@")[2]  # as given: several for redis+sentinel://
        parts = parts._replace(netloc=f"{parts.username or ''}:****@{hosts}")
    return urlunsplit(parts)

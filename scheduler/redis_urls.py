"""What a Redis URL of ggufq's names (pure: no connection is made): the
``redis+sentinel://`` form behind Sentinel (scheduler/store/sentinel.py), and kombu's form
of it for Celery.

    redis+sentinel://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/DB?master=NAME

USER and PASSWORD are the primary's; PORT is 26379 where not given;
``&sentinel_password=`` is the sentinels' own, if they ask for one. ``rediss+sentinel://``
speaks TLS to the sentinels and the primary alike, with a plain ``rediss://`` URL's
options: ``&ssl_ca_certs=PATH`` (the CA that signed their certificates),
``&ssl_cert_reqs=required`` (the default; ``none`` checks nothing), ``&ssl_certfile=`` and
``&ssl_keyfile=`` (a client certificate, where Redis asks for one), and
``&ssl_check_hostname=false`` where a server's certificate does not name the address the
sentinels announce for it (checked by default).
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

SCHEME = "redis+sentinel"
TLS_SCHEME = "rediss+sentinel"
SENTINEL_PORT = 26379
TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    tls: tuple[tuple[str, str], ...] | None = None  # TLS options (rediss+sentinel), else None

    @property
    def tls_options(self) -> dict[str, Any]:
        """redis-py's (and kombu's, Celery's) connection options for TLS; {} without."""
        return {} if self.tls is None else _tls_options(self.tls)

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


_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def _cert_reqs(value: str) -> ssl.VerifyMode:
    """``ssl_cert_reqs`` as given in a URL (required, optional, none; CERT_REQUIRED ...)."""
    found = _CERT_REQS.get(value.lower().removeprefix("cert_"))
    if found is None:
        raise ValueError(f"ssl_cert_reqs={value!r}: give required, optional or none")
    return found


def _tls_options(given: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """A URL's TLS options as redis-py takes them; ValueError names a wrong one."""
    options: dict[str, Any] = dict(given)
    options["ssl_cert_reqs"] = _cert_reqs(options.get("ssl_cert_reqs", "required"))
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = _yes(options["ssl_check_hostname"])
    return options


def _yes(value: str) -> bool:
    """A URL's true or false (``ssl_check_hostname``)."""
    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"ssl_check_hostname={value!r}: give true or false")
    return value.lower() in ("true", "1", "yes")


def is_sentinel(url: str | None) -> bool:
    scheme = str(url or "").split("://", 1)[0].lower()
    return bool(url) and "://" in str(url) and scheme in (SCHEME, TLS_SCHEME)


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
    tls: tuple[tuple[str, str], ...] | None
    tls = tuple((name, query[name][0]) for name in TLS_OPTIONS if query.get(name))
    if parts.scheme.lower() != TLS_SCHEME:
        if tls:
            raise ValueError(
                f"{tls[0][0]} is a TLS option: give the URL as rediss+sentinel:// for TLS"
            )
        tls = None
    else:
        _tls_options(tls)  # a wrong value is named here, not at the first connection
    return SentinelUrl(
        tuple(sentinels),
        master,
        int(db) if db.isdigit() else 0,
        unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password is not None else None,
        next(iter(query.get("sentinel_password", [])), None),
        tls,
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


def checked_url(url: str) -> str:
    """A URL of one Redis (or Valkey: the same protocol), its scheme in lower case
    (redis-py reads it so only); ValueError says plainly what to give otherwise."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    url = scheme + url[len(scheme) :]
    if scheme in ("redis", "rediss", "unix"):
        return url
    if scheme in (SCHEME, TLS_SCHEME):  # rediss: TLS, sentinels too
        parse(url)  # ValueError: what is missing
        return url
    if "cluster" in scheme:
        raise ValueError(
            "Redis Cluster is not supported: Celery's Redis transport (kombu) cannot use "
            "it; give one Redis or Valkey primary (redis://HOST:PORT/0, rediss:// for TLS)"
        )
    if "sentinel" in scheme:
        raise ValueError(
            "give Sentinel as redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]"
            "/DB?master=NAME (rediss+sentinel:// for TLS)"
        )
    raise ValueError(
        f"{scheme or 'no scheme'}: give redis://[USER:PASSWORD@]HOST:PORT/DB, rediss:// "
        "(TLS) or unix:///path/to/redis.sock"
    )


def split_urls(urls: str) -> list[str]:
    """The URLs of a comma-separated list. A Sentinel URL names its sentinels with commas
    too: a piece with no ``://`` belongs to the URL before it."""
    found: list[str] = []
    for piece in (p.strip() for p in urls.split(",")):
        if not piece:
            continue
        if found and "://" not in piece:
            found[-1] += "," + piece
        else:
            found.append(piece)
    return found


def address(url: str) -> str:
    """Where ``url`` leads, as any process's URL of it names it: host (lower case), port
    (6379 unless given) and database (0 unless given); the primary's name behind Sentinel;
    the path of a unix socket. TLS or not, and the credentials, do not matter here."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "unix":
        return f"unix:{parts.path}"
    if is_sentinel(url):
        found = parse(url)
        return f"sentinel:{found.master}/{found.db}"
    db = parts.path.strip("/") or "0"
    return f"{(parts.hostname or 'localhost').lower()}:{parts.port or 6379}/{db}"

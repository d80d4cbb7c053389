"""What the gateway checks of a request before any endpoint reads it: the name it was sent
to (Host), the page that sent it (Origin), that its body is JSON, and its body's size.

A keyless gateway on loopback trusts whoever can reach it, and a web page the user opens can
reach it: by a form or ``fetch`` from another site (cross-site request forgery: start jobs,
unload models), or by a name of the attacker's that resolves to 127.0.0.1 (DNS rebinding:
read the answers too). So a keyless gateway answers only Host names that mean this machine,
and every gateway refuses a request whose Origin is not one it was told to trust, and a
body that is not ``application/json`` (a browser sends a cross-site form or ``text/plain``
without asking first). Pure: headers in, an error or None out.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from api_client.gateway.errors import BadOrigin, RequestTooLarge, UnsupportedMediaType
from scheduler.errors import GgufqError

# pages a local gateway trusts by default, as Ollama's OLLAMA_ORIGINS does: this machine's
# own pages on any port, and the schemes desktop apps and editors serve their pages from
_DEFAULT_ORIGINS = tuple(
    f"{scheme}://{host}{port}"
    for scheme in ("http", "https")
    for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
    for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
UPLOAD_PATHS = frozenset({"/v1/files"})  # bodies are a form with a file (OpenAI's files API)


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated setting as its entries (spaces around each dropped)."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


@cache
def _this_machine() -> frozenset[str]:
    names = {"localhost"}
    try:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    except OSError:
        pass
    return frozenset(names)


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port (and without an IPv6 address's [])."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_local_name(name: str) -> bool:
    """Whether a keyless gateway answers a request sent to ``name``, as Ollama does: an IP
    address (a page cannot make a browser send one for a name of its own: only a name can
    be rebound), none (HTTP/1.0), localhost and ``*.localhost``, ``*.local``, ``*.internal``,
    or this machine's own host name."""
    if not name or name in _this_machine():
        return True
    if name.endswith((".localhost", ".local", ".internal")):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(host_header: str, extra: Iterable[str] = ()) -> bool:
    """Whether a keyless gateway answers a request sent to ``host_header``: a name of this
    machine, or one of ``extra`` (GGUFQ_HTTP_HOSTS; ``*`` allows any)."""
    name = host_name(host_header)
    return is_local_name(name) or any(fnmatch.fnmatchcase(name, p.lower()) for p in extra)


def origin_allowed(origin: str, extra: Iterable[str] = ()) -> bool:
    """Whether a page of ``origin`` may call the gateway: this machine's own pages and
    desktop apps', or one of ``extra`` (GGUFQ_HTTP_ORIGINS, ``*`` as a wildcard)."""
    origin = origin.strip().lower()
    return any(fnmatch.fnmatchcase(origin, p.lower()) for p in (*_DEFAULT_ORIGINS, *extra))


@dataclass(frozen=True)
class EdgeRules:
    """The gateway's edge settings: ``check_host`` for a keyless gateway; the extra names
    and origins it trusts; the largest body it reads."""

    check_host: bool
    hosts: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()
    max_body_bytes: int = 16 << 20
    max_upload_bytes: int = 200 << 20  # a batch's input file, with its form around it

    def body_limit(self, path: str) -> int:
        return self.max_upload_bytes + (1 << 20) if path in UPLOAD_PATHS else self.max_body_bytes

    def refusal(
        self, method: str, headers: dict[bytes, bytes], path: str = ""
    ) -> GgufqError | None:
        """Why a request must not reach an endpoint, or None."""
        host = headers.get(b"host", b"").decode("latin-1")
        if self.check_host and not host_allowed(host, self.hosts):
            return BadOrigin(
                f"this gateway answers requests for this machine's names only, not {host!r} "
                "(a web page could reach it through a name of its own); if clients reach it "
                "by that name, add it to GGUFQ_HTTP_HOSTS"
            )
        origin = headers.get(b"origin")
        if origin is not None and not origin_allowed(origin.decode("latin-1"), self.origins):
            return BadOrigin(
                f"requests from pages of {origin.decode('latin-1')!r} are not allowed; to let "
                "that site call this gateway, add it to GGUFQ_HTTP_ORIGINS"
            )
        if method in _BODY_METHODS and has_body(headers):
            length = headers.get(b"content-length", b"").strip()
            limit = self.body_limit(path)
            if length.isdigit() and int(length) > limit:
                return too_large(limit)
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if path in UPLOAD_PATHS and method == "POST":
                if media != b"multipart/form-data":
                    return UnsupportedMediaType(
                        f"a file is uploaded as multipart/form-data with parts 'file' and "
                        f"'purpose' (got {media.decode('latin-1') or 'none'}); with curl: "
                        "-F purpose=batch -F file=@requests.jsonl"
                    )
            elif media != b"application/json":
                got = media.decode("latin-1") or "none"
                return UnsupportedMediaType(
                    f"request bodies must be JSON sent as Content-Type: application/json (got "
                    f"{got}); with curl, add -H 'Content-Type: application/json'"
                )
        return None


def has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length", b"").strip()
    return b"transfer-encoding" in headers or (length not in (b"", b"0"))


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body is larger than this gateway takes ({limit:,} bytes, "
        "GGUFQ_HTTP_MAX_BODY_BYTES); send less, or raise the limit"
    )

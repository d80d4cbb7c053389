"""The gateway process: uvicorn serving the app on GGUFQ_HTTP_HOST:GGUFQ_HTTP_PORT.

API keys are required when it listens beyond loopback (GGUFQ_HTTP_AUTH=auto), so that a
gateway is never opened to a network by accident without them.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging

import uvicorn

from api_client.gateway.app import make_app
from api_client.gateway.writes import GatewayProtocol
from scheduler.settings import Settings, get_settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def keys_required(settings: Settings, host: str) -> bool:
    if settings.http_auth == "auto":
        return not is_loopback(host)
    return settings.http_auth == "on"


def serve(host: str | None = None, port: int | None = None, log_level: str = "info") -> None:
    settings = get_settings()
    host = host or settings.http_host
    port = port or settings.http_port
    app = make_app(settings, require_keys=keys_required(settings, host))
    logging.getLogger("ggufq.gateway").info(
        "gateway on http://%s:%d (API keys %s)",
        host,
        port,
        "required" if keys_required(settings, host) else "off",
    )
    uvicorn.run(  # no proxy headers: the gateway reads no client address, and that layer
        # would stay on the stack of every waiting request
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        http=GatewayProtocol,
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="listen address (default GGUFQ_HTTP_HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default GGUFQ_HTTP_PORT, 11434)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (info)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ggufq serve", description="the HTTP gateway")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.log_level)
    return 0

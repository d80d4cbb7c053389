"""A real gateway for the tests: uvicorn serving make_app on a free port, in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from api_client.gateway import make_app
from api_client.gateway.writes import GatewayProtocol
from scheduler.local.embedded import free_port
from scheduler.settings import Settings

# the session Redis's gateway user, by the administrator's URL (tests/conftest.py's stack):
# a test gateway meets Redis as a deployed one does, and what it is refused fails the session
AS_GATEWAY: dict[str, str] = {}


@contextmanager
def running_gateway(settings: Settings, require_keys: bool = False) -> Iterator[str]:
    """The gateway's base URL while it runs (stopped, and its client closed, after)."""
    url = AS_GATEWAY.get(settings.redis_url or "", settings.redis_url)
    settings = settings.model_copy(update={"redis_url": url})
    with serving(make_app(settings, require_keys=require_keys)) as base:
        yield base


@contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """The base URL of ``app`` served by uvicorn while the block runs."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=GatewayProtocol
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the test gateway on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)

"""The pool page: ``/ui`` (one HTML page, no build step, no framework: it polls) and the
JSON it draws, ``GET /api/pool`` (api_client/gateway/pool.py). The page needs no key; its
data obeys the caller's key (``/ui#key=...`` hands the page a key: a fragment never
reaches a server)."""

from __future__ import annotations

import time
from functools import cache
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse

from api_client.gateway.caller import caller_of
from api_client.gateway.core import Routes, gateway_of
from api_client.gateway.jobs_api import visible_jobs
from api_client.gateway.pool import pool_view

router = Routes()


@cache
def page() -> str:
    return resources.files("api_client.gateway").joinpath("ui/pool.html").read_text()


@router.add("/ui", "GET")
async def ui(_request: Request) -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


@router.add("/api/pool", "GET")
async def pool(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    jobs = await visible_jobs(request)
    devices, runners = await gateway.client.devices(), await gateway.client.ps()
    batches = await gateway.batches.active_batches(caller.only_tenant)

    def sees_model(model: str) -> bool:
        return caller.sees_all or gateway.may_see_runner(caller, model)

    return pool_view(
        devices,
        runners,
        jobs,
        [batch.as_openai() for batch in batches],
        time.time(),
        sees_model,
    )

"""The pool page: ``/ui`` (one HTML page, no build step, no framework: it polls) and the
JSON it draws, ``GET /api/pool`` (api_client/gateway/pool.py). The page needs no key; its
data obeys the caller's key (``/ui#key=...`` hands the page a key: a fragment never
reaches a server)."""

from __future__ import annotations

import asyncio
import time
from functools import cache
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse

from api_client.batches.runners import batch_store
from api_client.gateway.core import Routes, caller_of, gateway_of
from api_client.gateway.pool import pool_view
from scheduler.cluster import JobView

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
    client = gateway.client
    async with gateway.listing:  # one listing at a time: it reads every waiting job
        jobs = await asyncio.to_thread(client.sync.jobs)
    devices, runners = await client.devices(), await client.ps()
    admin = caller.key is None or caller.key.admin
    store = batch_store(client)
    batches = []
    for batch_id in await store.active():
        batch = await store.get(batch_id)
        if admin or batch.tenant == caller.tenant:
            batches.append(batch.as_openai())

    def sees_job(job: JobView) -> bool:
        return admin or job.tenant == caller.tenant

    def sees_model(model: str) -> bool:
        return admin or gateway.may_see_runner(caller, model)

    return pool_view(devices, runners, jobs, batches, time.time(), sees_model, sees_job)

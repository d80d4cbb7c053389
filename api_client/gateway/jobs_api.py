"""Jobs over HTTP, as Ollama's users ask for: a key's own jobs not ended yet
(``GET /api/jobs``), one of them (``GET /api/jobs/{id}``), and cancelling one
(``DELETE /api/jobs/{id}``: it stops wherever it is, parked, queued or running). A key sees
and cancels only its own jobs (its id is their tenant); an admin key, or a keyless
gateway, every job. A job just submitted and not yet placed, or already ended, is not
among them: 404."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from api_client.gateway.caller import caller_of
from api_client.gateway.core import Routes, gateway_of
from api_client.gateway.errors import JobNotFound
from scheduler.cluster import JobView

router = Routes()


async def visible_jobs(request: Request) -> list[JobView]:
    """The jobs not ended that the request's caller sees (one listing at a time: it reads
    every waiting job's record)."""
    gateway, caller = gateway_of(request), caller_of(request)
    async with gateway.listing:
        found = await asyncio.to_thread(gateway.client.sync.jobs)
    return [job for job in found if caller.sees(job.tenant)]


async def _one(request: Request) -> JobView:
    job_id = request.path_params["job_id"]
    for job in await visible_jobs(request):
        if job.id == job_id:
            return job
    raise JobNotFound(
        f"no job {job_id[:80]!r} of this API key is waiting or running (it ended, it was "
        "never submitted with this key, or placement has not taken it yet); the jobs listing "
        "shows this key's jobs"
    )


@router.add("/api/jobs", "GET")
async def jobs(request: Request) -> dict[str, Any]:
    return {"jobs": [job.model_dump(mode="json") for job in await visible_jobs(request)]}


@router.add("/api/jobs/{job_id}", "GET")
async def job(request: Request) -> dict[str, Any]:
    return (await _one(request)).model_dump(mode="json")


@router.add("/api/jobs/{job_id}", "DELETE")
async def cancel(request: Request) -> dict[str, Any]:
    found = await _one(request)
    await gateway_of(request).client.cancel(found.id)
    return {"id": found.id, "cancelled": True, "was": found.state}

"""What the gateway shows of the cluster, on an app in this process with a stand-in for the
cluster's client: /api/ps with a runner still loading, and /api/version."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import httpx
import ollama

from api_client.aio import AsyncClient
from api_client.gateway import make_app
from scheduler.cluster import RunnerView
from scheduler.settings import Settings

LOADING = RunnerView(
    id="r1",
    model="tiny",
    state="loading",
    devices={"vgpu:h:0": 3_000_000, "cpu:h": 1_000_000},
    bytes=3_000_000,
    size=4_000_000,
    context_length=2048,
    num_parallel=2,
    n_gpu_layers=-1,
    block_count=4,
    embedding=False,
    in_flight=1,
    keep_alive_s=300.0,
    expires_at=-1.0,  # busy: not counting down yet
    last_used=0.0,
    loaded_at=None,
    config_key="c0ffee",
)


class Cluster:
    """The part of AsyncClient that the endpoints here read."""

    def __init__(self, runners: list[RunnerView]) -> None:
        self.runners = runners

    async def ps(self) -> list[RunnerView]:
        return self.runners

    async def close(self) -> None:
        pass


def ask(tmp_path: Path, call: Any) -> Any:
    settings = Settings(redis_url=None, state_dir=tmp_path, models_dir=tmp_path)
    app = make_app(settings, client=cast(AsyncClient, Cluster([LOADING])))

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with ollama.AsyncClient(host="http://localhost", transport=transport) as api:
            return await call(api, transport)

    return asyncio.run(main())


def test_ps_shows_a_runner_that_is_still_loading(tmp_path: Path) -> None:
    async def both(api: ollama.AsyncClient, transport: httpx.ASGITransport) -> Any:
        async with httpx.AsyncClient(base_url="http://localhost", transport=transport) as raw:
            return await api.ps(), (await raw.get("/api/ps")).json()

    listed, raw = ask(tmp_path, both)
    assert [m.model for m in listed.models] == ["tiny"]
    row = raw["models"][0]
    assert row["state"] == "loading" and row["in_flight"] == 1
    assert row["size"] == 4_000_000 and row["size_vram"] == 3_000_000  # the host share is not
    # its idle clock has not started: it cannot expire before its keep_alive from now
    expires = listed.models[0].expires_at
    assert expires is not None and expires.timestamp() >= time.time() + 250


def test_version_is_ollamas_api_level_and_ggufqs_own(tmp_path: Path) -> None:
    async def get(_api: ollama.AsyncClient, transport: httpx.ASGITransport) -> Any:
        async with httpx.AsyncClient(base_url="http://localhost", transport=transport) as raw:
            return (await raw.get("/api/version")).json()

    answer = ask(tmp_path, get)
    assert answer["ggufq"] == version("ggufq")
    major, minor, *_ = (int(part) for part in answer["version"].split("."))
    assert (major, minor) >= (0, 5)  # tools turn structured outputs off below Ollama 0.5

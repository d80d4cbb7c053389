"""A model's load as waiting clients see it: Ollama-style ``load_progress`` lines in a
stream, the loading runner's progress in /api/ps and ``Client.ps()``, and a 503 with
Retry-After and the progress for a request that does not stream and waits past its budget.

The load is real llama.cpp, held at its first progress by the test (tests/held_worker.py):
the assertions wait on that event, never on a load being slow enough."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from api_client import Client
from api_client.gateway.loads import LoadBoard, LoadProgress
from scheduler.cluster import RunnerView
from scheduler.local.stack import LocalStack
from tests.conftest import settings_from, stack_env, wait_for
from tests.gateway_server import running_gateway
from tests.held_worker import hold_loads, let_loads_go
from workers.loadwatch import LoadWatch

Loading = tuple[Client, str]


@pytest.fixture(scope="module")
def loading(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loading]:
    """A stack whose worker holds each load at its first progress while the test asks,
    and a gateway whose requests that do not stream wait 0.5 s for a load."""
    root = tmp_path_factory.mktemp("loads")
    env = {
        **stack_env(models_dir, root / "state", host="loadhost"),
        "GGUFQ_HTTP_LOAD_WAIT_S": "0.5",
    }
    settings = settings_from(env, None)
    with LocalStack(
        settings, log_dir=root / "logs", extra_env=env, worker_module="tests.held_worker"
    ) as stack:
        gateway_settings = settings.model_copy(update={"redis_url": stack.redis_url})
        with (
            Client(stack.redis_url, settings=settings, timeout=60) as client,
            running_gateway(gateway_settings) as url,
        ):
            yield client, url


def test_clients_waiting_for_a_load_see_its_progress(loading: Loading) -> None:
    client, url = loading
    hold_loads(client.r)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    body = {**chat, "options": {"temperature": 0, "num_predict": 4}}
    try:
        with (
            ollama.Client(host=url) as api,
            httpx.stream("POST", f"{url}/api/chat", json=body, timeout=60) as response,
        ):
            lines = response.iter_lines()  # kept: dropping the generator closes the response
            first = json.loads(next(lines))
            # the runner's record carries the load's progress, held inside llama.cpp's load
            assert wait_for(lambda: any(r.load_progress for r in client.ps()), 30)
            (runner,) = client.ps()
            assert runner.state == "loading" and 0 < (runner.load_progress or 0) < 1
            ps = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
            assert ps[0]["state"] == "loading"
            assert ps[0]["load_progress"]["stage"] == "loading"

            # a request that does not stream gives up after its 0.5 s: 503, the progress
            waited = httpx.post(
                f"{url}/api/generate", json={**body, "prompt": "x", "stream": False}, timeout=30
            )
            assert waited.status_code == 503 and 1 <= int(waited.headers["retry-after"]) <= 60
            assert "still loading" in waited.json()["error"]
            assert waited.json()["load_progress"]["stage"] == "loading"
            openai = httpx.post(
                f"{url}/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=30
            )
            assert openai.status_code == 503
            assert openai.json()["error"]["code"] == "model_loading"
            assert 0 < openai.json()["error"]["load_progress"]["fraction"] < 1

            # the official client reads a stream that begins with progress lines
            answers: list[ollama.ChatResponse] = []
            reader = threading.Thread(target=lambda: answers.extend(api.chat(**chat, stream=True)))
            reader.start()

            seen = [first]
            while (
                "load_progress" not in seen[-1] or seen[-1]["load_progress"]["stage"] != "loading"
            ):
                seen.append(json.loads(next(lines)))
            assert all(not r["message"]["content"] and not r["done"] for r in seen)
            assert 0 < seen[-1]["load_progress"]["fraction"] < 1

            let_loads_go(client.r)
            rest = list(lines_until_text(lines))
            assert rest[-1]["message"]["content"] or rest[-1]["done"]
            reader.join(60)
        assert answers and answers[-1].done
        # the jobs answered 503 were cancelled: none is left waiting or running
        assert wait_for(lambda: client.jobs() == [], 30)
        (runner,) = client.ps()
        assert runner.state == "ready"
        assert "load_progress" not in httpx.get(f"{url}/api/ps").json()["models"][0]
    finally:
        let_loads_go(client.r)


def lines_until_text(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for raw in lines:
        record = json.loads(raw)
        yield record
        if record["message"]["content"] or record["done"]:
            return


def test_a_load_reports_its_first_progress_then_at_most_every_quarter_second_and_its_end() -> None:
    now = [0.0]
    heard: list[float] = []
    watch = LoadWatch(timeout_s=10, clock=lambda: now[0], report=heard.append)
    watch.progress(0.0)  # llama.cpp's first call: nothing read yet
    for step in range(1, 100):  # a callback every 10 ms
        now[0] = step / 100
        watch.progress(step / 100)
    now[0] += 0.01
    watch.progress(1.0)
    assert heard[0] == 0.01 and heard[-1] == 1.0
    assert heard == sorted(heard) and 4 <= len(heard) <= 6


def runner(model: str, state: str, progress: float | None, id: str = "r1") -> RunnerView:
    return RunnerView(
        id=id,
        model=model,
        state=state,  # type: ignore[arg-type]
        devices={},
        bytes=0,
        size=0,
        context_length=4096,
        num_parallel=1,
        n_gpu_layers=-1,
        block_count=1,
        embedding=False,
        in_flight=1,
        keep_alive_s=300,
        expires_at=-1,
        last_used=0,
        load_progress=progress,
    )


def reading(
    reads: list[list[RunnerView]], failing: list[bool]
) -> Callable[[], Awaitable[list[RunnerView]]]:
    """A board's read of the runners: the next of ``reads``, or Redis away while failing."""

    async def read() -> list[RunnerView]:
        if failing[0]:
            raise ConnectionError("Redis away")
        return reads.pop(0)

    return read


def test_a_model_is_loading_for_its_clients_only_while_no_runner_of_it_is_ready() -> None:
    now = [0.0]
    reads: list[list[RunnerView]] = [
        [
            runner("a", "loading", None),
            runner("b", "loading", 0.5, "r2"),
            runner("b", "ready", 1, "r3"),
        ],
        [runner("a", "loading", 0.2)],
        [runner("a", "loading", 0.6)],
    ]
    failing = [False]
    read = reading(reads, failing)

    async def main() -> list[LoadProgress | None]:
        board = LoadBoard(read, clock=lambda: now[0])
        seen = [await board.of("a"), await board.of("b")]  # one read: the second is recent
        for _ in range(2):
            now[0] += 2.0
            seen.append(await board.of("a"))
        failing[0] = True
        now[0] += 2.0
        seen.append(await board.of("a"))  # Redis away: what was known stays
        return seen

    waiting, b, first, second, kept = asyncio.run(main())
    assert waiting == LoadProgress("a", "waiting", 0.0, "r1") and b is None  # b has a ready one
    assert first is not None and first.stage == "loading" and first.seconds_left is None
    # 0.2 → 0.6 in 2 s: 0.4 left at 0.2 a second
    assert second is not None and second.seconds_left == pytest.approx(2.0)
    assert second.retry_after_s() == 2 and kept == second


def test_a_fresh_look_waits_for_a_read_begun_after_it_and_failed_reads_forget() -> None:
    now = [0.0]
    reads: list[list[RunnerView]] = [[runner("a", "loading", 0.3)], [runner("a", "ready", 1.0)]]
    failing = [False]
    read = reading(reads, failing)

    async def main() -> list[LoadProgress | None]:
        board = LoadBoard(read, clock=lambda: now[0])
        seen = [await board.of("a")]
        now[0] += 0.1  # a recent read would do for of(), not for now()
        seen.append(await board.now("a"))  # the runner is ready by now
        reads.append([runner("a", "loading", 0.5)])
        now[0] += 1.0
        seen.append(await board.of("a"))
        failing[0] = True
        now[0] += 1.0
        seen.append(await board.of("a"))  # one failed read: what was known stays
        now[0] += LoadBoard.FORGET_S
        seen.append(await board.of("a"))  # reads failing that long: forgotten
        return seen

    first, fresh, later, kept, forgotten = asyncio.run(main())
    assert first is not None and first.fraction == 0.3 and fresh is None
    assert later is not None and kept == later and forgotten is None

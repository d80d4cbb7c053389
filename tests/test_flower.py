"""Flower on the real stack: workers, queues and jobs through its REST API, and its pages
in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from api_client import Client
from scheduler.local.embedded import free_port
from scheduler.local.flower import with_pool_link
from scheduler.local.stack import LocalStack
from scheduler.store.acl import Role
from tests.conftest import needs_tool, settings_from, stack_env, wait_for
from tests.tinymodel import write_slow_model

WORKER = "ggufq-cpu@flowerhost"
LONG = {"temperature": 0, "num_predict": 6000, "num_ctx": 8192}


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def answers(url: str) -> bool:
    try:
        get(url)
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A stack with a model large enough that a long generation takes seconds."""
    root = tmp_path_factory.mktemp("flower")
    models = root / "models"
    models.mkdir()
    write_slow_model(models / "slow.gguf")
    env = stack_env(models, root / "state", host="flowerhost")
    with LocalStack(settings_from(env, None), log_dir=root / "logs", extra_env=env) as st:
        yield st


@contextmanager
def flower_on(url: str, env: dict[str, str], log_path: Path) -> Iterator[str]:
    """``ggufq flower`` on ``url`` (with ``env``, its API open); its base URL once it
    answers."""
    port = free_port()
    flower_env = {**os.environ, **env, "GGUFQ_REDIS_URL": url}
    flower_env["FLOWER_UNAUTHENTICATED_API"] = "true"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api_client.cli", "flower", "--port", str(port)],
            env=flower_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            started = wait_for(lambda: answers(base + "/api/workers"), timeout=60)
            assert started, f"flower did not start: see {log_path}"
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def flower(slow_stack: LocalStack) -> Iterator[str]:
    assert slow_stack.log_dir is not None
    log = slow_stack.log_dir / "flower.log"
    monitor = slow_stack.role_urls[Role.MONITOR]  # Flower's read-only user
    with flower_on(monitor, slow_stack.extra_env, log) as base:
        assert "/ui" in log.read_text(errors="replace")  # it tells where the pool page is
        yield base


def test_flower_shows_workers_queues_and_jobs(flower: str, slow_stack: LocalStack) -> None:
    assert wait_for(lambda: WORKER in get(flower + "/api/workers?refresh=1"), timeout=30)
    with Client(slow_stack.redis_url, settings=slow_stack.settings, timeout=60) as client:
        job = client.submit("slow", "the sky is", options=LONG)
        info = flower + f"/api/task/info/{job.id}"

        def state() -> str:
            return str(get(info)["state"]) if answers(info) else ""

        # custom states while it runs: LOADING, GENERATING, and CANCELLED at the end
        assert wait_for(lambda: state() == "GENERATING", timeout=60)
        # the worker stays online while it generates (heartbeats from their own thread)
        assert get(flower + "/api/workers?status=true")[WORKER] is True
        job.cancel()
        assert wait_for(lambda: state() == "CANCELLED", timeout=60)
        done = client.submit("slow", "blue", options={**LONG, "num_predict": 4})
        done.result()
    finished = flower + f"/api/task/info/{done.id}"
    # events arrive a bit later (a worker sends them 50 ms after they are made): until then
    # Flower does not know the task
    assert wait_for(lambda: answers(finished) and get(finished)["state"] == "SUCCESS")
    task = get(finished)
    assert task["name"] == "ggufq.run"
    assert task["worker"] == WORKER
    assert f"model='slow', job={done.id}, prompt='blue'" in task["args"]

    # Flower asks every worker for its queues and lists those that answered in time
    # (from what they answered at its last refresh)
    def queues() -> set[str]:
        get(flower + "/api/workers?refresh=1")
        return {q["name"] for q in get(flower + "/api/queues/length")["active_queues"]}

    assert wait_for(lambda: {"ggufq.cpu.flowerhost", "ggufq.cpu.flowerhost.batch"} <= queues())


def test_flower_links_to_the_pool_page(flower: str) -> None:
    with urllib.request.urlopen(flower + "/workers", timeout=10) as response:
        page = response.read().decode()
    link = re.search(r'<a class="nav-link" id="ggufq-pool" href="([^"]+)"[^>]*>Pool</a>', page)
    assert link is not None, "Flower's bar has no link to the pool page"
    assert link.group(1).startswith("http://") and link.group(1).endswith("/ui")
    assert ">Workers</a>" in page and ">Broker</a>" in page  # Flower's own pages stay


def test_plain_celery_form_finds_the_app(slow_stack: LocalStack) -> None:
    env = {**os.environ, **slow_stack.extra_env, "GGUFQ_REDIS_URL": slow_stack.redis_url}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "scheduler.local.flower", "inspect", "ping"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and WORKER in out.stdout, out.stdout + out.stderr


@needs_tool("chromium", "apt-get install chromium")
def test_dashboard_pages_in_headless_chromium(flower: str, slow_stack: LocalStack) -> None:
    assert slow_stack.log_dir is not None
    for page in ("workers", "tasks"):
        shot = slow_stack.log_dir / f"flower-{page}.png"
        dom = chromium(flower + f"/{page}", shot)
        assert WORKER in dom, f"the {page} page does not show the worker"
        assert 'id="ggufq-pool"' in dom  # the link to the pool page, in the rendered bar
        assert shot.stat().st_size > 10_000


def chromium(url: str, screenshot: Path) -> str:
    """Render a page in headless Chromium (as this machine allows: no sandbox, no network
    beyond localhost); saves a screenshot and returns the DOM after its scripts ran."""
    flags = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={screenshot.parent / 'chromium-profile'}",
        "--virtual-time-budget=5000",
        "--window-size=1400,900",
    ]
    subprocess.run(
        [*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True
    )
    out = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout


def test_a_flower_bar_this_does_not_know_gets_no_link(tmp_path: Path) -> None:
    templates, into = tmp_path / "templates", tmp_path / "into"
    templates.mkdir()
    (templates / "navbar.html").write_text("<nav><ul class='other'></ul></nav>")
    assert not with_pool_link(templates, "http://localhost:11434/ui", into)
    assert not into.exists()  # Flower keeps its own pages
    (templates / "navbar.html").write_text('<ul class="app-nav navbar-nav"><li>W</li></ul>')
    assert with_pool_link(templates, "http://h/ui?{{ x }}", into)
    bar = (into / "navbar.html").read_text()
    assert 'href="http://h/ui?%7B%7B x %7D%7D"' in bar and bar.index("Pool") < bar.index("</ul>")

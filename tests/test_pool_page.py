"""The pool page (``/ui``) and its data (``/api/pool``): rendered in headless Chromium on a
real gateway in front of the real stack, its bars and rows held to ``Client.devices()`` and
``Client.ps()``; a key limited to one model sees only that model's runners and jobs."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from api_client import Client
from api_client.gateway.keys import KeyStore
from api_client.gateway.pool import pool_view
from scheduler.cluster import DeviceView, JobView, RunnerView
from scheduler.local.stack import LocalStack
from tests.conftest import needs_tool, settings_from, stack_env, wait_for
from tests.gateway_server import running_gateway
from tests.held_worker import HOLD, release
from tests.test_flower import chromium

GIB = 1 << 30
HELD = "tests.held_worker"


def device(id: str, total: int, reserved: int) -> DeviceView:
    return DeviceView(
        id=id,
        host="h",
        worker="w",
        name=id,
        kind="vgpu",
        total=total,
        reported_free=total - reserved,
        reserved=reserved,
        virtual=True,
        queue="q",
        heartbeat=0.0,
    )


def runner(id: str, model: str, on: dict[str, int], busy: int = 0) -> RunnerView:
    return RunnerView(
        id=id,
        model=model,
        state="ready",
        devices=on,
        bytes=sum(on.values()),
        size=sum(on.values()),
        context_length=512,
        num_parallel=2,
        n_gpu_layers=-1,
        block_count=2,
        embedding=False,
        in_flight=busy,
        keep_alive_s=300.0,
        expires_at=130.0 if not busy else -1,
        last_used=0.0,
    )


def job(model: str, tenant: str, state: str, submitted_at: float) -> JobView:
    return JobView(
        id=f"{model}-{submitted_at}",
        model=model,
        priority="interactive",
        tenant=tenant,
        state=state,
        position=0,
        submitted_at=submitted_at,  # type: ignore[arg-type]
    )


def test_the_pool_view_draws_bars_rows_and_queues_and_hides_other_keys_models() -> None:
    devices = [device("vgpu:h:0", 2 * GIB, GIB), device("vgpu:h:1", GIB, 0)]
    runners = [
        runner("r1", "a", {"vgpu:h:0": GIB // 2}),
        runner("r2", "b", {"vgpu:h:0": GIB // 2}, busy=1),
    ]
    jobs = [
        job("a", "t1", "parked", 90.0),
        job("a", "t1", "parked", 95.0),
        job("b", "t2", "queued", 99.0),
        job("a", "t1", "running", 80.0),
    ]
    everyone = pool_view(devices, runners, jobs, [], 100.0, lambda _m: True)
    first = everyone["devices"][0]
    assert [(s["model"], s["bytes"]) for s in first["runners"]] == [
        ("a", GIB // 2),
        ("b", GIB // 2),
    ]
    assert everyone["devices"][1]["runners"] == [] and everyone["devices"][1]["free"] == GIB
    assert [
        (r["model"], r["busy"], r["slots"], r["expires_in_s"]) for r in everyone["runners"]
    ] == [
        ("a", 0, 2, 30.0),
        ("b", 1, 2, None),
    ]
    assert everyone["queues"] == [
        {"model": "a", "tenant": "t1", "parked": 2, "queued": 0, "oldest_wait_s": 10.0},
        {"model": "b", "tenant": "t2", "parked": 0, "queued": 1, "oldest_wait_s": 1.0},
    ]
    # a key of model a, tenant t1: b's memory is "other", b's runner and jobs are not there
    own = [j for j in jobs if j.tenant == "t1"]  # as the endpoint lists them for the key
    mine = pool_view(devices, runners, own, [], 100.0, lambda m: m == "a")
    assert [(s["model"], s["bytes"]) for s in mine["devices"][0]["runners"]] == [
        ("a", GIB // 2),
        ("other", GIB // 2),
    ]
    assert [r["model"] for r in mine["runners"]] == ["a"]
    assert [q["model"] for q in mine["queues"]] == ["a"]


@pytest.fixture()
def loaded(stack: LocalStack, client: Client) -> Iterator[Client]:
    client.generate("tiny", "the sky is", options={"num_predict": 2, "temperature": 0})
    yield client


@needs_tool("chromium", "apt-get install chromium")
def test_the_pool_page_shows_each_devices_bar_and_each_runner(
    url: str, loaded: Client, stack: LocalStack
) -> None:
    assert stack.log_dir is not None
    shot = stack.log_dir / "pool-page.png"  # kept with the stack's logs: a test artifact
    dom = chromium(f"{url}/ui", shot)
    assert shot.stat().st_size > 10_000
    for d in loaded.devices():
        assert f'data-id="{d.id}"' in dom, f"no bar for device {d.id}"
    for r in loaded.ps():
        assert r.id in dom, f"no row for runner {r.id}"
        for device_id, reserved in r.devices.items():
            share = re.search(
                rf'data-id="{re.escape(device_id)}".*?data-model="{re.escape(r.model)}" '
                rf'data-bytes="(\d+)"',
                dom,
                flags=re.S,
            )
            assert share is not None and int(share[1]) == reserved


@needs_tool("chromium", "apt-get install chromium")
def test_a_key_of_one_model_sees_only_that_model(
    stack: LocalStack, loaded: Client, r: redis.Redis, tmp_path: Path
) -> None:
    key, token = KeyStore(r).create("pool-viewer", models=["gemma3-270m"])
    try:
        with running_gateway(stack.settings, require_keys=True) as url:
            assert httpx.get(f"{url}/ui").status_code == 200  # the page itself needs no key
            assert httpx.get(f"{url}/api/pool").status_code == 401
            pool = httpx.get(f"{url}/api/pool", headers={"Authorization": f"Bearer {token}"}).json()
            assert pool["runners"] == [] or {x["model"] for x in pool["runners"]} == {"gemma3-270m"}
            shares = {s["model"] for d in pool["devices"] for s in d["runners"]}
            assert "tiny" not in shares and "other" in shares
            dom = chromium(f"{url}/ui#key={token}", tmp_path / "keyed.png")
            assert 'data-model="other"' in dom and 'data-model="tiny"' not in dom
    finally:
        KeyStore(r).revoke(key.id)


@pytest.fixture(scope="module")
def pool(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Two virtual GPUs on two hosts (2 GiB and 1 GiB), three models, one slot a runner
    and no job let wait at a runner: a second job of a busy model parks. The workers hold
    a job whose prompt starts with HOLD: until the test releases it."""
    root = tmp_path_factory.mktemp("pool")
    models = root / "models"
    models.mkdir()
    for name in ("tiny", "tiny-b", "tiny-c"):
        shutil.copy(models_dir / "tiny.gguf", models / f"{name}.gguf")
    env = {
        **stack_env(models, root / "state", host="p1"),
        "GGUFQ_MAX_REPLICAS": "1",
        "GGUFQ_RUNNER_QUEUE": "0",
    }
    settings = settings_from(env, None)
    with LocalStack(
        settings,
        worker_args=["--virtual-gpu", "2GiB"],
        log_dir=root / "logs",
        extra_env=env,
        worker_module=HELD,
    ) as st:
        st.add_worker("worker-p2", ["--virtual-gpu", "1GiB"], {"GGUFQ_HOST_ID": "p2"}, HELD)
        yield st


@needs_tool("chromium", "apt-get install chromium")
def test_the_page_follows_two_gpus_three_models_and_a_parked_job(pool: LocalStack) -> None:
    assert pool.log_dir is not None
    settings = pool.settings.model_copy(update={"redis_url": pool.redis_url})
    with Client(pool.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: len(client.devices()) == 2)
        for model in ("tiny", "tiny-b", "tiny-c"):
            client.load(model)
        with running_gateway(settings) as url:
            dom = chromium(f"{url}/ui", pool.log_dir / "pool-two-gpus.png")
            devices, runners = client.devices(), client.ps()
            assert len(devices) == 2 and len(runners) == 3
            for d in devices:
                drawn = re.search(rf'data-id="{re.escape(d.id)}".*?</div></div>', dom, re.S)
                assert drawn is not None, f"no bar for {d.id}"
                on = {r.model: r.devices[d.id] for r in runners if d.id in r.devices}
                shares = re.findall(r'data-model="([^"]+)" data-bytes="(\d+)"', drawn[0])
                assert {m: int(b) for m, b in shares} == on
            busy = client.submit("tiny", f"{HOLD} hold the slot", options={"num_predict": 8})
            assert wait_for(lambda: any(r.in_flight for r in client.ps() if r.model == "tiny"))
            parked = client.submit("tiny", "then me", options={"num_predict": 4})
            assert wait_for(lambda: any(j.state == "parked" for j in client.jobs()))
            tiny_rows = r'<tr class="row"><td>tiny</td><td>default</td><td>(\d+)</td>'

            def shown(shot: str) -> list[str] | None:
                """The page's rows of tiny's waiting jobs, once its data came (its
                devices drawn): its fetch ends after Chromium's virtual time on a busy
                machine, so the page is rendered again until it has."""
                dom = chromium(f"{url}/ui", pool.log_dir / shot)  # type: ignore[operator]
                return re.findall(tiny_rows, dom) if "data-id=" in dom else None

            assert wait_for(lambda: shown("pool-parked.png") == ["1"], timeout=60), (
                "the parked job is not on the page"
            )
            release(client.r, busy.id)
            assert parked.result(timeout=60).done and busy.result(timeout=60).done
            assert wait_for(lambda: shown("pool-after.png") == [], timeout=60)

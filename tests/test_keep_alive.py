"""keep_alive as documented, on a real stack: the runner's value as it is when its last job
ends decides (an unload or a keep_alive 0 asked while it was busy is not lost), a job that
omits keep_alive keeps the runner's value, and a non-finite duration is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from api_client import Client, InvalidRequest
from scheduler.local.stack import LocalStack
from scheduler.store import keys
from tests.conftest import settings_from, stack_env, wait_for
from tests.held_worker import HOLD, release
from tests.tinymodel import write_slow_model

BUSY = {"temperature": 0, "num_predict": 8, "num_ctx": 8192}  # held: its length is the release
QUICK = {"temperature": 0, "num_predict": 2, "num_ctx": 8192}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    root = tmp_path_factory.mktemp("keepalive")
    models = root / "models"
    models.mkdir()
    write_slow_model(models / "slow.gguf")
    env = stack_env(models, root / "state", host="kahost")
    settings = settings_from(env, None)
    held = "tests.held_worker"  # HOLD: jobs stay running until released
    with LocalStack(settings, log_dir=root / "logs", extra_env=env, worker_module=held) as st:
        with Client(st.redis_url, settings=settings, timeout=120) as c:
            yield c


def busy_runner(client: Client) -> object:
    """A runner that never expires on its own, busy with a job that streamed and is held
    running until the test releases it."""
    client.load("slow", keep_alive=-1, options={"num_ctx": 8192})
    job = client.submit("slow", f"{HOLD} go on", options=BUSY)
    next(iter(job.stream(cancel_on_close=False)))
    assert [r.in_flight for r in client.ps()] == [1]
    return job


def test_an_unload_asked_while_busy_happens_when_the_last_job_ends(client: Client) -> None:
    job = busy_runner(client)
    before = {why: counted(client, why) for why in ("unloads", "expiries")}
    assert len(client.unload("slow")) == 1
    assert client.ps()  # still serving its job
    release(client.r, job.id)  # type: ignore[attr-defined]
    assert job.result(timeout=120).done  # type: ignore[attr-defined]
    assert wait_for(lambda: not client.ps(), timeout=30)
    # counted as asked (ggufq unload), though it happened as its last job ended
    assert wait_for(lambda: counted(client, "unloads") == before["unloads"] + 1)
    assert counted(client, "expiries") == before["expiries"]


def counted(client: Client, why: str) -> float:
    """How many of `slow`'s runners the workers counted unloaded for ``why``."""
    return float(client.r.hget(keys.STATS, f"{why}|slow") or 0)  # type: ignore[arg-type]


def test_a_keep_alive_zero_job_on_a_busy_runner_unloads_it_after_the_last(
    client: Client,
) -> None:
    first = busy_runner(client)
    second = client.submit("slow", "and go", options=QUICK, keep_alive=0)
    assert wait_for(lambda: [r.in_flight for r in client.ps()] == [2])  # while first runs
    release(client.r, first.id)  # type: ignore[attr-defined]
    assert second.result(timeout=120).done  # type: ignore[attr-defined]
    assert first.result(timeout=120).done  # type: ignore[attr-defined]
    assert wait_for(lambda: not client.ps(), timeout=30)


def test_a_job_cancelled_in_the_queue_leaves_the_runner_s_keep_alive(client: Client) -> None:
    first = busy_runner(client)
    queued = client.submit("slow", "waits for the slot", options=QUICK)
    assert wait_for(lambda: [r.in_flight for r in client.ps()] == [2])  # queued at the runner
    queued.cancel()
    release(client.r, first.id)  # type: ignore[attr-defined]
    assert first.result(timeout=120).done  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="cancel"):
        queued.result(timeout=120)
    assert wait_for(lambda: [r.in_flight for r in client.ps()] == [0], timeout=30)
    assert [(r.keep_alive_s, r.expires_at) for r in client.ps()] == [(-1, -1)]
    client.unload("slow")
    assert wait_for(lambda: not client.ps(), timeout=30)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), "inf", "1000000h"])
def test_durations_that_cannot_be_meant_are_refused(client: Client, bad: float | str) -> None:
    with pytest.raises(InvalidRequest, match="keep_alive_s"):
        client.submit("slow", "hi", options=QUICK, keep_alive=bad)

"""Hosts whose clocks are far off, as an operator meets them (a worker and a placement
process run with their wall clocks 30 s behind: tests/clock_offset): liveness is judged on
Redis's clock, so the worker keeps its device and serves, and the placement process keeps
the jobs it holds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api_client import Client
from scheduler.local.stack import LocalStack
from scheduler.settings import Settings
from scheduler.store import keys
from tests.conftest import settings_from, stack_env, wait_for

SHORT = {"temperature": 0, "num_predict": 4}
OFFSET_DIR = Path(__file__).parent / "clock_offset"


def behind(seconds: int) -> dict[str, str]:
    """The environment that runs a Python process with its wall clock ``seconds`` behind."""
    path = os.pathsep.join(p for p in (str(OFFSET_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "GGUFQ_TEST_CLOCK_OFFSET_S": str(-seconds)}


Skewed = tuple[LocalStack, Settings]


@pytest.fixture(scope="module")
def skewed(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Skewed]:
    """A stack on host h1 (placement and a 2 GiB virtual GPU) beside a worker on host h2
    (1 GiB) and a second placement process, both with clocks 30 s behind. Device TTL 5 s,
    heartbeats every 0.5 s: before beats were stamped on Redis's clock, h2's device looked
    dead at every look of the h1 placement."""
    tmp = tmp_path_factory.mktemp("skew")
    env = stack_env(models_dir, tmp / "state", host="h1")
    settings = settings_from(env, None)
    with LocalStack(
        settings, worker_args=["--virtual-gpu", "2GiB"], log_dir=tmp / "logs", extra_env=env
    ) as stack:
        late = behind(30)
        stack.add_worker("worker-h2", ["--virtual-gpu", "1GiB"], {"GGUFQ_HOST_ID": "h2", **late})
        stack.add_process("placement-late", "scheduler.placement.process", env=late)
        yield stack, settings


def test_a_worker_whose_clock_is_30s_behind_keeps_its_device_and_serves(
    skewed: Skewed,
) -> None:
    stack, settings = skewed
    with Client(stack.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: {d.id for d in client.devices()} >= {"vgpu:h2:0"}, 60)
        events = client.r.pubsub(ignore_subscribe_messages=True)
        events.subscribe(keys.EVENTS)
        jobs = [
            client.submit("tiny", f"pinned {i}", options=SHORT, device="vgpu:h2:0")
            for i in range(8)
        ]
        finals = [job.result() for job in jobs]
        assert all(f.done and f.eval_count for f in finals)
        # over two device TTLs of beats, its device was never dropped and joined again
        deadline_beats = int(2 * settings.device_ttl_s / settings.heartbeat_interval_s)
        rejoined = []
        for _ in range(deadline_beats):
            message = events.get_message(timeout=settings.heartbeat_interval_s)
            if message is not None:
                event = json.loads(message["data"])
                if event.get("event") == "device_joined" and event["device"] == "vgpu:h2:0":
                    rejoined.append(event)
        events.close()
        assert rejoined == []
        assert "vgpu:h2:0" in {d.id for d in client.devices()}


def test_a_placement_process_whose_clock_is_30s_behind_keeps_what_it_holds(
    skewed: Skewed,
) -> None:
    stack, settings = skewed
    with Client(stack.redis_url, settings=settings, timeout=60) as client:
        r: redis.Redis = client.r
        assert wait_for(lambda: len(r.zrange(keys.PLACEMENT_ALIVE, 0, -1)) == 2, 60)
        jobs = [client.submit("tiny", f"burst {i}", options=SHORT) for i in range(30)]
        assert all(job.result().done for job in jobs)
        # the other placement process took none of the late one's jobs from it (each taken
        # would be marked swept in its custody record), and both still count as alive
        records = list(r.scan_iter(match=keys.job_custody("*")))
        assert len(records) >= 30
        assert [k for k in records if r.hget(k, "swept") not in (None, b"")] == []
        beats = r.zrange(keys.PLACEMENT_ALIVE, 0, -1, withscores=True)
        (redis_now, _micros) = r.time()
        assert all(redis_now - beat < settings.device_ttl_s for _name, beat in beats)

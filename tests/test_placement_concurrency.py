"""Several placement processes and dozens of concurrent clients against real Redis and
virtual GPUs: memory is never over-committed, nothing leaks, every job is served."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from api_client import Client
from scheduler.gguf.estimate import estimate_bytes
from scheduler.gguf.metadata import read_model_info
from scheduler.local.stack import LocalStack
from scheduler.protocol import RunnerConfig
from scheduler.store import keys
from tests.conftest import settings_from, stack_env


def invariants(r: redis.Redis) -> list[str]:
    """Check reservations against capacity and runners, from one atomic read (MULTI)."""
    devices = sorted(x.decode() for x in r.smembers(keys.DEVICES))
    pipe = r.pipeline(transaction=True)
    pipe.smembers(keys.RUNNERS)
    for dev in devices:
        pipe.hget(keys.device(dev), "total")
        pipe.hgetall(keys.reservations(dev))
    replies = pipe.execute()
    runners = {x.decode() for x in replies[0]}
    problems = []
    for n, dev in enumerate(devices):
        total = int(replies[1 + 2 * n] or 0)
        held = {k.decode(): int(v) for k, v in replies[2 + 2 * n].items()}
        if sum(held.values()) > total:
            problems.append(f"{dev}: reserved {sum(held.values())} > total {total}")
        if set(held) - runners:
            problems.append(f"{dev}: reservations of unknown runners {set(held) - runners}")
    return problems


def test_many_placers_and_clients(models_dir: Path, tmp_path: Path) -> None:
    info = read_model_info(models_dir / "tiny.gguf")
    size = estimate_bytes(info, RunnerConfig(2048, flash_attn=True))
    env = {**stack_env(models_dir, tmp_path / "state", host="multi"), "GGUFQ_MAX_QUEUE": "512"}
    settings = settings_from(env, None)
    # two virtual GPUs that hold one runner each: with three configurations in play,
    # placement must park, evict and reload
    worker = ["--virtual-gpu", str(size + size // 4), "--virtual-gpu", str(size + size // 8)]
    with LocalStack(
        settings, worker_args=worker, log_dir=tmp_path / "logs", extra_env=env
    ) as stack:
        extra = [
            subprocess.Popen(
                [sys.executable, "-m", "scheduler.placement.process"],
                env={**os.environ, **env, "GGUFQ_REDIS_URL": stack.redis_url},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(2)
        ]
        r = redis.Redis.from_url(stack.redis_url)
        seen: list[str] = []
        stop = threading.Event()

        def monitor() -> None:
            while not stop.is_set():
                seen.extend(invariants(r))
                stop.wait(0.02)

        watcher = threading.Thread(target=monitor)
        watcher.start()
        try:
            with Client(stack.redis_url, settings=settings, timeout=120) as client:

                def one(i: int) -> tuple[str, int]:
                    ctx = (512, 1024, 2048)[i % 3]
                    result = client.generate(
                        "tiny",
                        f"job {i}",
                        options={"num_ctx": ctx, "num_predict": 8, "temperature": 0},
                    )
                    return result.done_reason or "", result.load_duration or 0

                with ThreadPoolExecutor(max_workers=24) as pool:
                    results = list(pool.map(one, range(48)))
                assert len(results) == 48
                assert all(reason in ("stop", "length") for reason, _ in results)
                # three configurations, room for two runners: some runner was evicted
                assert sum(1 for _, load in results if load > 0) >= 3
                assert client.jobs() == []
        finally:
            stop.set()
            watcher.join()
            for proc in extra:
                proc.terminate()
                proc.wait(timeout=30)
        assert seen == []
        assert invariants(r) == []
        assert int(r.zcard(keys.PLACEMENT_ALIVE)) >= 1
        r.close()

"""The control plane under load: real Redis, scripts, Celery queues and placement processes,
simulated workers for 1,000 devices, jobs at rising rates (issue 38).

    .venv/bin/python bench/control_plane.py [--hosts 100] [--devices 10] [--models 100]
        [--rates 25,50,100,200] [--seconds 8] [--tokens 64] [--token-rate 640]
        [--placements 2] [--submitters 4]

An embedded Redis, ``--placements`` placement processes (``python -m
scheduler.placement.process``), and this process for everything else:

- simulated workers, speaking the worker's protocol for ``--hosts`` x ``--devices``
  virtual devices without llama.cpp: each host beats for its devices (heartbeat.lua) and
  takes its devices' Celery messages off their queues (BRPOP, one connection a host, as a
  worker's consumer does); each job marks its runner ready on its first job (as after a
  load), starts (start.lua), writes its ``--tokens`` tokens at ``--token-rate`` tokens a
  second as a worker's writer does (a chunk every 0.1 s, append.lua), ends (end.lua) and
  stores its Celery result;
- clients (``--submitters`` threads, each a Python ``Client``) submitting one-shot jobs of
  ``--models`` models at random, open loop, at each rate of ``--rates`` for ``--seconds``,
  the fast path included, as a real client does.

Per rate: jobs offered and ended a second; placement latency (a job's submit to its send,
by placement or the fast path: its hops) p50 and p99; the longest gap between a host's
beats and the devices reaped (a beat missed); Redis commands a job (``INFO
commandstats``, less the idle rate). A rate holds when its p99 placement is <= 10 ms, no
device was reaped, every job ended, and the jobs ended at >= 95 % of the rate offered;
the bench reports the highest that holds. Streams live on the one Redis
(``GGUFQ_STREAM_REDIS_URLS`` is not built). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import simworkers  # noqa: E402
from custody_scale import calibrate  # noqa: E402
from simworkers import HB_S, TALLY, TTL_S  # noqa: E402
from tinystack import tiny_models  # noqa: E402

from api_client import Client  # noqa: E402
from scheduler.local.embedded import EmbeddedRedis  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.store import keys  # noqa: E402
from scheduler.store.records import text  # noqa: E402

P99_MS = 10.0
SLOTS = 8  # a runner's parallel slots


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def commands(r: redis.Redis) -> float:
    return float(r.info("stats")["total_commands_processed"])


def redis_cpu_s(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def tally(r: redis.Redis) -> dict[str, float]:
    """What the simulated workers counted: jobs ended, the longest beat gap, devices reaped."""
    raw = cast(dict[bytes, bytes], r.hgetall(TALLY))
    return {text(k): float(v) for k, v in raw.items()}


def step(
    clients: list[Client],
    r: redis.Redis,
    rate: float,
    idle_per_s: float,
    args: Any,
    apart: list[redis.Redis],
) -> dict[str, Any]:
    """Offer ``rate`` jobs a second for ``args.seconds``; wait for them to end; figures.
    ``apart``: the stream instances, when streams live apart from ``r``."""
    total = int(rate * args.seconds)
    ids: list[str] = []
    lock = threading.Lock()
    begun = time.monotonic()
    before, ended_before, cpu = commands(r), tally(r).get("ended", 0.0), redis_cpu_s(r)
    streams_before = [(commands(a), redis_cpu_s(a)) for a in apart]

    def submit(k: int) -> None:
        rng = random.Random(k)
        for n in range(k, total, len(clients)):
            delay = begun + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            model = f"m{rng.randrange(args.models):04d}"
            job = clients[k].submit(model, "x", options={"num_predict": args.tokens})
            with lock:
                ids.append(job.id)

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    offered_s = time.monotonic() - begun
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and tally(r).get("ended", 0.0) - ended_before < len(ids):
        time.sleep(0.05)
    took = time.monotonic() - begun
    control, cpu = commands(r) - before, redis_cpu_s(r) - cpu
    on_streams = [
        (commands(a) - c, redis_cpu_s(a) - u)
        for a, (c, u) in zip(apart, streams_before, strict=True)
    ]
    used = control + sum(c for c, _u in on_streams)
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job_hops(job_id), "submitted", "sent")
        pipe.hget(keys.job_custody(job_id), "state")
    found = pipe.execute()
    waits = [
        (float(sent) - float(sub)) * 1000
        for sub, sent in found[::2]
        if sub is not None and sent is not None
    ]
    ended = sum(state == b"done" for state in found[1::2])
    workers = tally(r)
    return {
        "rate": rate,
        "offered": len(ids),
        "offered_per_s": round(len(ids) / offered_s, 1),
        "ended": ended,
        "ended_per_s": round(ended / took, 1),
        "place_p50_ms": round(pct(waits, 0.5), 2),
        "place_p99_ms": round(pct(waits, 0.99), 2),
        "commands_a_job": round((used - idle_per_s * took) / max(1, len(ids)), 1),
        "control_commands_a_job": round((control - idle_per_s * took) / max(1, len(ids)), 1),
        "redis_cpu": round(cpu / took, 2),  # the control Redis's, of one core
        "stream_cpu_max": round(max((u for _c, u in on_streams), default=0.0) / took, 2),
        "beat_gap_s": round(workers.get("beat_gap_s", 0.0), 2),
        "reaped": int(workers.get("reaped", 0)),
    }


def holds(row: dict[str, Any]) -> bool:
    return (
        row["place_p99_ms"] <= P99_MS
        and row["reaped"] == 0
        and row["ended"] == row["offered"]
        and row["offered_per_s"] >= 0.95 * row["rate"]
    )


def placement_env(url: str, models: Path, state: Path, stream_urls: str) -> dict[str, str]:
    return {
        **os.environ,
        "GGUFQ_REDIS_URL": url,
        "GGUFQ_STREAM_REDIS_URLS": stream_urls,
        "GGUFQ_MODELS_DIR": str(models),
        "GGUFQ_STATE_DIR": str(state),
        "GGUFQ_HEARTBEAT_INTERVAL_S": str(HB_S),
        "GGUFQ_DEVICE_TTL_S": str(TTL_S),
        "GGUFQ_METRICS_PORT": "0",
        "GGUFQ_NUM_PARALLEL": str(SLOTS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--devices", type=int, default=10, help="devices a host")
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--rates", default="25,50,100,200", help="jobs a second, in turn")
    parser.add_argument("--seconds", type=float, default=8.0, help="each rate's length")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a job")
    parser.add_argument("--token-rate", type=float, default=640.0, help="tokens a second a job")
    parser.add_argument("--placements", type=int, default=2, help="placement processes")
    parser.add_argument("--submitters", type=int, default=4, help="client threads")
    parser.add_argument(
        "--stream-instances",
        type=int,
        default=0,
        help="Redis instances of the token streams (GGUFQ_STREAM_REDIS_URLS); 0: the one Redis",
    )
    parser.add_argument("--as-workers", nargs=2, help=argparse.SUPPRESS)  # url, device bytes
    args = parser.parse_args()
    if args.as_workers:
        return simworkers.play(args)
    root = Path(tempfile.mkdtemp(prefix="ggufq-control-"))
    models = root / "models"
    models.mkdir()
    tiny_models(models, args.models)
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    r = redis.Redis.from_url(url)
    instances = [EmbeddedRedis(root / f"streams{n}") for n in range(args.stream_instances)]
    stream_urls = ",".join(instance.start() for instance in instances)
    apart = [redis.Redis.from_url(instance.url) for instance in instances]
    procs: list[subprocess.Popen[bytes]] = []
    clients: list[Client] = []
    rows: list[dict[str, Any]] = []
    idle_per_s = 0.0
    logs = root / "processes.log"
    try:
        size = calibrate(models, SLOTS) * 3 // 2  # one runner a device
        env = placement_env(url, models, root / "state", stream_urls)
        with open(logs, "ab") as log:
            workers = [sys.executable, __file__, "--as-workers", url, str(size)]
            argv = [*workers, *sys.argv[1:]]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
            started = lambda: bool(r.exists(TALLY)) or procs[0].poll() is not None  # noqa: E731
            wait_until(started, 60, f"the simulated workers did not start: see {logs}")
            argv = [sys.executable, "-m", "scheduler.placement.process"]
            for _ in range(args.placements):
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        settings = Settings(
            redis_url=url, models_dir=models, device_ttl_s=TTL_S, stream_redis_urls=stream_urls
        )
        clients = [Client(url, settings=settings, timeout=60) for _ in range(args.submitters)]
        beating = lambda: clients[0].health()["placement"] >= args.placements  # noqa: E731
        wait_until(beating, 60, f"placement did not start: see {logs}")
        for i in range(args.models):  # each model's runner loaded
            clients[0].submit(f"m{i:04d}", "x", options={"num_predict": 1})
        loaded = lambda: tally(r).get("ended", 0.0) >= args.models  # noqa: E731
        wait_until(loaded, 120, f"the models did not load in 120 s: see {logs}")
        before, idle_s = commands(r), 3.0
        time.sleep(idle_s)
        idle_per_s = (commands(r) - before) / idle_s
        for rate in (float(x) for x in args.rates.split(",")):
            rows.append(step(clients, r, rate, idle_per_s, args, apart))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        r.close()
        server.stop()
        for client, instance in zip(apart, instances, strict=True):
            client.close()
            instance.stop()
    report(args, rows, idle_per_s)


def wait_until(ready: Any, timeout_s: float, failed: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(failed)
        time.sleep(0.1)


def report(args: Any, rows: list[dict[str, Any]], idle_per_s: float) -> None:
    print()
    print(
        f"{'rate':>7}{'offered/s':>11}{'ended/s':>9}{'place p50':>11}{'p99 ms':>10}"
        f"{'beat gap':>10}{'reaped':>8}{'cmds/job':>10}{'control':>9}{'Redis CPU':>11}"
        f"{'streams':>9}  holds"
    )
    for row in rows:
        print(
            f"{row['rate']:>7.0f}{row['offered_per_s']:>11.1f}{row['ended_per_s']:>9.1f}"
            f"{row['place_p50_ms']:>11.2f}{row['place_p99_ms']:>10.2f}{row['beat_gap_s']:>9.2f}s"
            f"{row['reaped']:>8}{row['commands_a_job']:>10.1f}"
            f"{row['control_commands_a_job']:>9.1f}{row['redis_cpu']:>11.2f}"
            f"{row['stream_cpu_max']:>9.2f}  {'yes' if holds(row) else 'no'}"
        )
    held = [row["rate"] for row in rows if holds(row)]
    best = max(held, default=0.0)
    print(
        f"{args.hosts} hosts x {args.devices} devices, {args.models} models, "
        f"{args.placements} placement processes, jobs of {args.tokens} tokens; "
        f"idle: {idle_per_s:.0f} Redis commands a second; "
        f"highest rate held (p99 placement <= {P99_MS:.0f} ms, no beat missed): {best:.0f} jobs/s"
    )
    result = {
        "bench": "control_plane",
        "hosts": args.hosts,
        "devices_a_host": args.devices,
        "models": args.models,
        "placements": args.placements,
        "tokens": args.tokens,
        "token_rate": args.token_rate,
        "stream_instances": args.stream_instances or 1,
        "streams_apart": bool(args.stream_instances),
        "rows": rows,
        "idle_commands_per_s": round(idle_per_s, 1),
        "highest_rate_held": best,
        "target_met": best >= 2000,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

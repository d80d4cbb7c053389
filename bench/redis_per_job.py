"""What a job costs Redis, counted: commands by name and bytes, from submit to result.

    .venv/bin/python bench/redis_per_job.py [--jobs 200] [--tokens 64] [--concurrency 8]

A local stack (embedded Redis, placement, one worker with a virtual GPU, a tiny model with
``--concurrency`` slots) first runs one job (the model loads), then counts two windows of
the same length with Redis's own counters (``INFO commandstats``, ``INFO stats``): one
while ``--jobs`` jobs of ``--tokens`` tokens stream through the Python client,
``--concurrency`` at a time, and one idle (heartbeats, placement's looks, the client's
leases). A job's cost is the busy window less the idle one, over the jobs. Issue 38 asks
for this count before cutting what buys nothing. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tinystack import tiny_llama_state

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = "tiny"

Counts = dict[str, float]


def snapshot(r: Any) -> tuple[Counts, Counts]:
    """(calls and microseconds by command, the server's totals) now. A script's time
    (``evalsha``) includes the time of the commands it calls, which count again under
    their own names."""
    calls: Counts = {}
    for name, stats in r.info("commandstats").items():
        calls[name.removeprefix("cmdstat_")] = float(stats["calls"])
        calls["usec:" + name.removeprefix("cmdstat_")] = float(stats["usec"])
    stats, cpu = r.info("stats"), r.info("cpu")
    totals = {
        "commands": float(stats["total_commands_processed"]),
        "bytes_in": float(stats["total_net_input_bytes"]),
        "bytes_out": float(stats["total_net_output_bytes"]),
        "cpu_us": (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6,
    }
    return calls, totals


def window(before: tuple[Counts, Counts], after: tuple[Counts, Counts]) -> tuple[Counts, Counts]:
    calls = {k: after[0][k] - before[0].get(k, 0.0) for k in after[0]}
    totals = {k: after[1][k] - before[1][k] for k in after[1]}
    return calls, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    from api_client import Client
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings

    parallel = str(args.concurrency)
    state, env = tiny_llama_state("ggufq-redis-per-job-", MODEL, GGUFQ_NUM_PARALLEL=parallel)
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    options = {"temperature": 0, "num_predict": args.tokens}
    with LocalStack(settings, ["--virtual-gpu", "2GiB"], state / "logs", env) as stack:
        with Client(stack.redis_url, settings=settings, timeout=120) as client:
            client.generate(MODEL, "warm up", options=options)  # loaded, routes known

            def one(n: int) -> int:
                chunks = 0
                for _chunk in client.generate(MODEL, f"job {n}", stream=True, options=options):
                    chunks += 1
                return chunks

            r = client.r
            start, began = snapshot(r), time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                chunks = list(pool.map(one, range(args.jobs)))
            busy_s = time.monotonic() - began
            busy = window(start, snapshot(r))
            start = snapshot(r)
            time.sleep(busy_s)
            idle = window(start, snapshot(r))
    per_job = {
        name: (calls - idle[0].get(name, 0.0)) / args.jobs for name, calls in busy[0].items()
    }
    per_job = {k: v for k, v in per_job.items() if v > 0.005}
    usec = {k.removeprefix("usec:"): per_job.pop(k) for k in list(per_job) if k[:5] == "usec:"}
    totals = {k: (busy[1][k] - idle[1][k]) / args.jobs for k in busy[1]}
    # INFO's own calls, and this bench's snapshots, are not the jobs'
    totals["commands"] -= sum(per_job.pop(k, 0.0) for k in ("info",))
    usec.pop("info", None)
    print(
        f"{args.jobs} jobs of {args.tokens} tokens, {args.concurrency} at a time, in "
        f"{busy_s:.1f} s; {sum(chunks) / args.jobs:.1f} chunks a job at the reader; idle "
        f"window {idle[1]['commands'] / busy_s:.0f} commands/s"
    )
    print(f"{'command':28}{'calls a job':>12}{'µs a job':>10}")
    for name, calls in sorted(per_job.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{name:28}{calls:>12.2f}{usec.get(name, 0.0):>10.1f}")
    print(
        f"{'all commands':28}{totals['commands']:>12.1f}\n{'bytes in (to Redis)':28}"
        f"{totals['bytes_in']:>12.0f}\n{'bytes out (from Redis)':28}{totals['bytes_out']:>12.0f}"
        f"\n{'Redis CPU a job (µs)':28}{totals['cpu_us']:>12.0f}"
    )
    report = {
        "bench": "redis_per_job",
        "jobs": args.jobs,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "busy_s": round(busy_s, 2),
        "chunks_a_job": round(sum(chunks) / args.jobs, 1),
        "idle_commands_per_s": round(idle[1]["commands"] / busy_s, 1),
        "per_job": {k: round(v, 2) for k, v in sorted(per_job.items(), key=lambda kv: -kv[1])},
        "usec_a_job": {k: round(v, 1) for k, v in sorted(usec.items(), key=lambda kv: -kv[1])},
        "commands_a_job": round(totals["commands"], 1),
        "redis_cpu_us_a_job": round(totals["cpu_us"]),
        "bytes_in_a_job": round(totals["bytes_in"]),
        "bytes_out_a_job": round(totals["bytes_out"]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

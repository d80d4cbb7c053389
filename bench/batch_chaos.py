"""A server-side batch through the faults an operator meets, counted: the gateway process
driving it SIGKILLed twice, the worker once, placement once, and Redis killed and started
again (from its append-only file, ``appendfsync everysec``), while no client waits on it.

    .venv/bin/python bench/batch_chaos.py [--lines 2000] [--bound-s 900]

One local stack (a tiny generated llama, 4 slots; heartbeats every 0.5 s, device TTL 5 s),
two gateway processes that drive batches (leases of 3 s), and a batch of ``--lines``
``/v1/completions`` lines submitted from Python (``Client.submit_batch``: the bench then
only watches Redis). Each fault is injected once the batch has answered a share of its
lines (10 %, 25 %, 40 %, 55 %, 70 %: events, not a clock); the stack's supervisor starts
again whatever died, as ``ggufq up`` does. Counted once the batch ended (or the bound
passed): every custom_id in the output and error files exactly once (missing, twice), the
lines' outcomes by error code, the jobs handed to a worker more than once (a job is run
again once when its worker died before it streamed: each such line is still answered
once), the jobs run to their end twice (the worker's log), and how long the batch took.
Targets: the batch ends completed, 0 missing, 0 answered twice, 0 run twice.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tinystack import tiny_llama_state

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = "tiny"
FAULTS = (
    (0.10, "driver"),
    (0.25, "worker"),
    (0.40, "driver"),
    (0.55, "placement"),
    (0.70, "redis"),
)


def inject(fault: str, stack: Any, r: Any, batch_id: str) -> str:
    from scheduler.store import keys

    if fault == "driver":
        holder = r.get(keys.batch_lease(batch_id))
        if holder is None:
            return "no driver held it"
        pid = int(holder.decode().split(":")[1])
        os.kill(pid, signal.SIGKILL)
        return f"gateway {pid} killed"
    if fault == "redis":
        stack.redis.proc.kill()
        stack.redis.proc.wait()
        return "redis killed"
    name, proc = next((n, p) for n, p in stack.procs if n == fault)
    proc.kill()
    return f"{name} {proc.pid} killed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--bound-s", type=float, default=900)
    args = parser.parse_args()

    import redis

    from api_client import Client
    from api_client.batches.handle import BatchHandle
    from scheduler.local.embedded import free_port
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings
    from scheduler.store import keys
    from scheduler.store.acl import Role

    state, env = tiny_llama_state(
        "ggufq-batch-chaos-",
        MODEL,
        GGUFQ_HOST_ID="chaos",
        GGUFQ_HEARTBEAT_INTERVAL_S="0.5",
        GGUFQ_DEVICE_TTL_S="5",
        GGUFQ_NUM_PARALLEL="4",
        GGUFQ_BATCH_LEASE_S="3",
        GGUFQ_HTTP_PORT=str(free_port()),
    )
    env["GGUFQ_DATA_DIR"] = str(state / "data")
    os.environ.update(env)
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    settings = settings.model_copy(update={"data_dir": state / "data"})
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"count {i}:", "max_tokens": 6, "seed": i},
        }
        for i in range(args.lines)
    ]
    path = state / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    injected: list[tuple[str, float, str]] = []
    with LocalStack(settings, [], state / "logs", env) as stack:
        for name in ("gateway-a", "gateway-b"):
            port = {"GGUFQ_HTTP_PORT": str(free_port())}
            stack.add_process(name, "api_client.gateway", env=port, role=Role.GATEWAY)
        r = redis.Redis.from_url(stack.redis_url)
        ours = settings.model_copy(update={"redis_url": stack.redis_url})
        with Client(stack.redis_url, settings=ours) as client:
            started = time.monotonic()
            handle = client.submit_batch(path)
            final: dict[str, Any] = {}
            pending = list(FAULTS)
            while time.monotonic() - started < args.bound_s:
                stack.supervise()  # as `ggufq up`: what died starts again
                try:
                    record = r.hmget(keys.batch(handle.id), "state", "completed", "failed")
                except redis.RedisError:
                    time.sleep(0.2)
                    continue
                done = int(record[1] or 0) + int(record[2] or 0)
                if record[0] in (b"completed", b"failed", b"expired", b"cancelled"):
                    final = handle.status()
                    break
                if pending and done >= pending[0][0] * args.lines:
                    share, fault = pending.pop(0)
                    what = inject(fault, stack, r, handle.id)
                    injected.append((fault, time.monotonic() - started, what))
                    print(f"{time.monotonic() - started:6.1f} s  {share:.0%} answered: {what}")
                time.sleep(0.05)
            seconds = time.monotonic() - started
            answered = BatchHandle(client, handle.id).results() if final else []
    # each run of a job the worker logs: Celery's "received" and "succeeded" of ggufq.run
    runs: Counter[str] = Counter()
    delivered: Counter[str] = Counter()
    for log in (state / "logs").glob("worker*.log"):
        for text in log.read_bytes().decode(errors="replace").splitlines():
            found = re.search(r"Task ggufq\.run\[(batch_\w+-\d+)\] (received|succeeded)", text)
            if found:
                (delivered if found[2] == "received" else runs)[found[1]] += 1
    ids = Counter(x["custom_id"] for x in answered)
    twice = sum(1 for n in ids.values() if n > 1)
    missing = args.lines - len(ids)
    outcomes = Counter(
        "ok"
        if x["response"] and x["response"]["status_code"] == 200
        else (x["error"] or x["response"]["body"]["error"])["code"]
        for x in answered
    )
    twice_run = sum(1 for n in runs.values() if n > 1)
    rerun = sum(1 for n in delivered.values() if n > 1)
    print()
    print(f"{'faults':<10}{', '.join(f for f, _, _ in injected)}")
    print(f"{'status':<10}{final.get('status', 'not ended')} in {seconds:.1f} s")
    print(f"{'lines':<10}{args.lines}: {dict(outcomes)}")
    print(f"{'missing':<10}{missing}    answered twice: {twice}    run twice: {twice_run}")
    print(f"{'again':<10}{rerun} jobs handed to a worker again (nothing streamed: run once more)")
    print(
        json.dumps(
            {
                "bench": "batch_chaos",
                "lines": args.lines,
                "faults": [f for f, _, _ in injected],
                "status": final.get("status"),
                "seconds": round(seconds, 1),
                "outcomes": dict(outcomes),
                "missing": missing,
                "answered_twice": twice,
                "run_twice": twice_run,
                "delivered_again": rerun,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Many waiting clients on one gateway process: its Redis connections, its memory per client,
and how fast each is served once its job can run.

    python bench/gateway_load.py [--clients 1000,10000] [--slots 8]

A local stack (embedded Redis, placement, a worker with one virtual GPU just large enough
for one runner of a tiny model) runs a job of another model ("hog") and is then stopped
(SIGSTOP; its device's TTL is long), so the hog's runner stays busy and the jobs of the
tiny model ("load", ``--slots`` slots) park for memory, with no CPU spent on the hog
meanwhile. One gateway process runs beside it. For each number of clients, a client
process of this script opens that many streaming ``/api/generate`` requests (raw HTTP on
loopback, a few hundred at a time), each job one token. They wait, parked, getting
keep-alive lines; once every client has its response head, the bench reads the gateway's
resident memory (over its size before the clients came, per waiting client) and counts
the TCP connections the gateway process holds to Redis (with what each did last, as
Redis's CLIENT LIST says). Then it cancels the hog's job and lets the worker go on
(SIGCONT): the idle hog is evicted, and every client is served; each notes when its first
real line came, and the bench reads when the worker sent that job's first chunk to Redis
(its ``first_chunk_written`` hop): the difference is the time to first byte once served,
Redis's own time to run the chunk's script and the gateway's. The clients stop themselves
after ``--timeout`` seconds.

Targets (issue 34): Redis connections of the gateway <= 8, resident memory per waiting
client <= 20 KB, 0 errors. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tinystack import tiny_state, wait_answering

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL, HOG = "load", "hog"
BATCH = 250  # clients connecting at once
KEEPALIVE_S = 5.0  # the default
ENV = {
    "GGUFQ_MAX_REPLICAS": "1",
    "GGUFQ_MAX_QUEUE": "100000",  # parked jobs before new ones are refused
    "GGUFQ_HTTP_KEEPALIVE_S": str(KEEPALIVE_S),
    "GGUFQ_METRICS_PORT": "0",
    "GGUFQ_DEVICE_TTL_S": "3600",  # the stopped worker's device stays
}


# -- the client process ----------------------------------------------------------------------
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int) -> Connection:
    opening = asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    return await asyncio.wait_for(opening, 150)  # past the kernel's SYN retries


async def one_client(port: int, out: dict[str, Any], conn: Connection | BaseException) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "hi", "stream": True, "options": {"num_predict": 1}}
    ).encode()
    if isinstance(conn, BaseException):
        out["error"] = f"connect: {type(conn).__name__}: {conn}"
        return
    reader, writer = conn
    head = (
        f"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body)
    try:
        status = (await reader.readline()).split(b" ", 2)
        out["status"] = int(status[1]) if len(status) > 1 else 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "x-ggufq-job":
                out["job"] = value.strip()
        out["head_at"] = time.time()
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            pending += await reader.readexactly(size)
            await reader.readexactly(2)
            *lines, pending = pending.split(b"\n")
            for text in lines:
                record = json.loads(text)
                if "error" in record:
                    out["error"] = record["error"]
                elif (record.get("response") or record.get("done")) and "served_at" not in out:
                    out["served_at"] = time.time()
                    out["first"] = record
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def clients(port: int, n: int, timeout_s: float, progress: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    tasks = []
    for start in range(0, n, BATCH):
        # a batch's connections made before the next batch's begin: a storm of SYNs past
        # the accept backlog is dropped, and after the kernel's retries (about 2 minutes)
        # some clients never connect (seen at 10,000: ListenOverflows by the 100,000)
        batch = range(start, min(n, start + BATCH))
        conns = await asyncio.gather(*(connect(port) for _ in batch), return_exceptions=True)
        tasks += [
            asyncio.create_task(one_client(port, results[i], conn))
            for i, conn in zip(batch, conns, strict=True)
        ]
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + timeout_s
    while not all(t.done() for t in tasks) and time.monotonic() < deadline:
        heads = sum(1 for r in results if "head_at" in r)
        progress.write_text(json.dumps({"heads": heads, "done": sum(t.done() for t in tasks)}))
        await asyncio.sleep(0.5)
    for task in tasks:
        task.cancel()  # past the deadline: the bench stops itself
    await asyncio.gather(*tasks, return_exceptions=True)
    return results


def client_main(port: int, n: int, timeout_s: float, progress: Path, out: Path) -> None:
    results = asyncio.run(clients(port, n, timeout_s, progress))
    out.write_text(json.dumps(results))


# -- the bench ------------------------------------------------------------------------------------
def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def redis_connections(pid: int, redis_port: int) -> set[int]:
    """The local ports of the TCP connections of process ``pid`` to ``redis_port`` (from
    /proc: its socket inodes, and the kernel's table of loopback connections)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == redis_port and fields[9] in inodes and fields[3] == "01":
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


def last_commands(r: Any, ports: set[int]) -> dict[str, int]:
    """What the connections from ``ports`` last did, as Redis's CLIENT LIST says."""
    found: dict[str, int] = {}
    for c in r.client_list():
        if int(str(c.get("addr", ":0")).rsplit(":", 1)[1]) in ports:
            found[c.get("cmd", "?")] = found.get(c.get("cmd", "?"), 0) + 1
    return found


def run(
    n: int, args: argparse.Namespace, stack: Any, client: Any, pids: tuple[int, int], port: int
) -> dict[str, Any]:
    from scheduler.store import hops, keys

    r = client.r
    gateway_pid, worker_pid = pids
    redis_port = int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
    hog = client.submit(HOG, "x", options={"num_predict": 1_000_000})
    next(iter(hog.stream(cancel_on_close=False)))  # running: its runner is busy
    os.kill(worker_pid, signal.SIGSTOP)  # and stays so, at no cost, until released
    before_kb = rss_kb(gateway_pid)
    work = Path(tempfile.mkdtemp(prefix="ggufq-load-"))
    progress, out = work / "progress.json", work / "results.json"
    argv = [__file__, "--client-process", str(port), str(n), str(args.timeout)]
    proc = subprocess.Popen([sys.executable, *argv, str(progress), str(out)])
    deadline = time.monotonic() + args.timeout
    heads = 0
    while time.monotonic() < deadline and proc.poll() is None and heads < n:
        time.sleep(1.0)
        try:
            heads = json.loads(progress.read_text())["heads"]
        except (OSError, ValueError):
            continue
        print(f"  {heads} of {n} clients waiting", file=sys.stderr, flush=True)
    time.sleep(KEEPALIVE_S)  # settled: every client waits
    waiting_kb = rss_kb(gateway_pid)
    ports = redis_connections(gateway_pid, redis_port)
    connections, commands = len(ports), last_commands(r, ports)
    parked = r.zcard(keys.PARKED)
    released = time.time()
    hog.cancel()
    os.kill(worker_pid, signal.SIGCONT)
    proc.wait(timeout=args.timeout + 60)
    results = json.loads(out.read_text())
    served = [x for x in results if "served_at" in x and "error" not in x]
    errors = [x for x in results if x not in served or x.get("status") != 200]
    ttfb = []
    for x in served:
        written = hops.read(r, x["job"]).get("first_chunk_written") if "job" in x else None
        if written is not None:
            ttfb.append(max(0.0, (x["served_at"] - written) * 1000))
    last = max((x["served_at"] for x in served), default=released)
    return {
        "clients": n,
        "waiting_heads": heads,
        "parked_at_release": int(parked),
        "gateway_redis_connections": connections,
        "their_last_commands": commands,
        "gateway_rss_mb_before": round(before_kb / 1024, 1),
        "gateway_rss_per_waiting_client_kb": round((waiting_kb - before_kb) / max(1, n), 2),
        "errors": len(errors),
        "error_samples": [x.get("error") or x.get("status") for x in errors[:3]],
        "all_served_s": round(last - released, 1),
        "ttfb_once_served_ms": {
            "p50": round(statistics.median(ttfb), 2) if ttfb else None,
            "p99": round(sorted(ttfb)[int(0.99 * (len(ttfb) - 1))], 2) if ttfb else None,
        },
    }


def runner_bytes(state: Path) -> int:
    """What one runner of the tiny model reserves (placed once on a large virtual GPU)."""
    from api_client import Client
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings

    settings = Settings(redis_url=None, state_dir=state / "calibrate", models_dir=state / "models")
    env = {**ENV, "GGUFQ_STATE_DIR": str(state / "calibrate")}
    with LocalStack(settings, ["--virtual-gpu", "8GiB"], state / "calibrate", env) as stack:
        with Client(stack.redis_url, settings=settings) as client:
            client.load(MODEL)
            return max(row.size for row in client.ps())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--clients", default="1000,10000", help="numbers of clients, comma-separated"
    )
    parser.add_argument("--slots", type=int, default=8, help="slots of the model's one runner")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a round may take")
    args = parser.parse_args()

    from api_client import Client
    from scheduler.local.embedded import free_port
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings
    from scheduler.store.acl import Role

    state, tiny = tiny_state("ggufq-load-")
    tiny.write_tiny_llama(state / "models" / f"{MODEL}.gguf")
    tiny.write_tiny_model(state / "models" / f"{HOG}.gguf", endless=True)
    port = free_port()
    ENV.update(
        GGUFQ_MODELS_DIR=str(state / "models"),
        GGUFQ_HTTP_PORT=str(port),
        GGUFQ_NUM_PARALLEL=str(args.slots),
    )
    one = runner_bytes(state)
    gpu = f"{(one + one // 2) // (1 << 20)}MiB"  # one runner, not two
    env = {**ENV, "GGUFQ_STATE_DIR": str(state)}
    os.environ.update(env)
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    rows = []
    with LocalStack(settings, ["--virtual-gpu", gpu], state / "logs", env) as stack:
        gateway = stack.add_process("gateway", "api_client.gateway", role=Role.GATEWAY)
        worker = next(proc for name, proc in stack.procs if name == "worker")
        client = Client(stack.redis_url, settings=settings, timeout=args.timeout)
        wait_answering(f"http://127.0.0.1:{port}/")  # before the clients come
        for n in (int(x) for x in args.clients.split(",")):
            rows.append(run(n, args, stack, client, (gateway.pid, worker.pid), port))
        client.close()
    print(
        f"{'clients':>8}{'waiting':>9}{'parked':>8}{'redis conns':>13}{'KB/client':>11}"
        f"{'errors':>8}{'served in':>11}{'ttfb p50':>10}{'p99':>8}  (ms)"
    )
    for row in rows:
        t = row["ttfb_once_served_ms"]
        print(
            f"{row['clients']:>8}{row['waiting_heads']:>9}{row['parked_at_release']:>8}"
            f"{row['gateway_redis_connections']:>13}{row['gateway_rss_per_waiting_client_kb']:>11}"
            f"{row['errors']:>8}{row['all_served_s']:>10}s{t['p50'] or 0:>10}{t['p99'] or 0:>8}"
        )
    met = all(
        r["gateway_redis_connections"] <= 8
        and r["gateway_rss_per_waiting_client_kb"] <= 20
        and r["errors"] == 0
        for r in rows
    )
    print(
        "targets (<= 8 Redis connections, <= 20 KB a waiting client, 0 errors): "
        + ("met" if met else "NOT met")
    )
    print(json.dumps({"bench": "gateway_load", "slots": args.slots, "rows": rows, "met": met}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client-process":
        _, _, port, n, timeout_s, progress, out = sys.argv
        client_main(int(port), int(n), float(timeout_s), Path(progress), Path(out))
    else:
        main()

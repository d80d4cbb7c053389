"""Added latency of the HTTP gateway over the Python client, on the same resident model.

The same short request three ways (raw prompt, 16 new tokens, greedy): through the Python
client, and through the gateway's `/api/generate` read with httpx (what the official
`ollama` and `openai` packages are built on) and with a lean HTTP client of the bench's own
(one kept socket, the request in one write, the chunked NDJSON read line by line), every
order of the three in turn so that machine noise hits all alike: time to first token and
end to end, and the paired median of what the gateway adds (its process beside the stack,
as `ggufq up` runs it). The lean client shows what the gateway adds; the httpx arm adds
httpx's own work (0.5–1 ms a request here) to that. Then short requests per second through
one gateway process with 1, 8 and 32 concurrent clients, and through llama-server's own
HTTP server on the same file after the stack is gone, when its binary is given (same slots,
context per slot, threads and flash attention; `/completion`, no prompt cache). Prints a
table, then one JSON line (the httpx arm's figures at the top level, the lean one's under
"lean").

    python bench/gateway.py [--requests 100] [--model-file some.gguf] [--server PATH]

On a small machine whose cores also run the model, the paired differences spread over
several milliseconds, mostly in the cluster's time from a job's submission to its first
chunk, which varies from job to job; the quartiles printed beside the median say how far
to trust it. So the gateway's own share is measured too, with that time left out: the
request side (from the request's start to the moment the job is made, which Redis records)
and the response side (from the first chunk's publication, as a subscriber of its own sees
it, to the client's first line). Both include the HTTP client's own work and one more
process wake-up each way; the gateway process's own time, what a proxy's "overhead"
usually means (LiteLLM's, for one), is read from its Server-Timing header.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from paired import against, median_ci

PROMPT = "The capital of France is"
OPTIONS = {"temperature": 0, "num_predict": 16, "seed": 1}
SLOTS = 8  # the runner's (GGUFQ_NUM_PARALLEL), and llama-server's --parallel
LEVELS = (1, 8, 32)  # concurrent clients for requests per second


@dataclass(frozen=True)
class Run:
    ttft_s: float
    e2e_s: float
    job: str
    started_at: float  # wall clock, to set beside the times other processes record
    first_at: float
    server_ms: float | None = None  # the gateway's own time before its first byte


def client_once(client, model: str) -> Run:  # type: ignore[no-untyped-def]
    wall, started = time.time(), time.perf_counter()
    first, first_at, job = None, 0.0, ""
    for chunk in client.generate(model, PROMPT, stream=True, options=OPTIONS):
        if first is None:
            first, first_at, job = time.perf_counter(), time.time(), chunk.job_id or ""
    ended = time.perf_counter()
    return Run((first or ended) - started, ended - started, job, wall, first_at)


def gateway_once(http: httpx.Client, model: str) -> Run:
    body = {"model": model, "prompt": PROMPT, "raw": True, "options": OPTIONS}
    wall, started = time.time(), time.perf_counter()
    with http.stream("POST", "/api/generate", json=body) as response:
        return read_answer(response.headers, response.iter_lines(), wall, started)


def read_answer(
    headers: Mapping[str, str], lines: Iterable[str | bytes], wall: float, started: float
) -> Run:
    """Read a streamed answer's NDJSON ``lines`` to the end: its timings, its job (a header)
    and the gateway's own time (its Server-Timing header)."""
    first, first_at = None, 0.0
    for line in lines:
        if first is None and json.loads(line).get("response"):
            first, first_at = time.perf_counter(), time.time()
    ended = time.perf_counter()
    timing = re.search(r"gateway;dur=([0-9.]+)", headers.get("server-timing", ""))
    server_ms = float(timing.group(1)) if timing else None
    job = headers.get("x-ggufq-job", "")
    return Run((first or ended) - started, ended - started, job, wall, first_at, server_ms)


class Lean:
    """HTTP/1.1 on one kept socket doing no more than this request needs: head and body in
    one write, the chunked NDJSON answer read line by line. The gateway measured with an
    HTTP client's own work as small as it can be; httpx, which the official clients are
    built on, takes 0.5–1 ms of its own per request on this machine."""

    def __init__(self, host: str, port: int) -> None:
        self.host = f"{host}:{port}"  # a keyless gateway answers its own names only
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, str], Iterator[bytes]]:
        """Send a POST; its headers, and its body's lines as they arrive."""
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        self.sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status = self.file.readline().split()
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"gateway answered {status!r} {headers}")
        return headers, self._lines(headers)

    def _lines(self, headers: dict[str, str]) -> Iterator[bytes]:
        if "content-length" in headers:
            yield from self.file.read(int(headers["content-length"])).splitlines()
            return
        pending = b""
        while size := int(self.file.readline().split(b";")[0], 16):
            pending += self.file.read(size)
            self.file.readline()  # the CRLF after a chunk
            *lines, pending = pending.split(b"\n")
            yield from lines
        self.file.readline()  # the CRLF after the last (empty) chunk
        if pending:
            yield pending

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def lean_once(lean: Lean, model: str) -> Run:
    body = {"model": model, "prompt": PROMPT, "raw": True, "options": OPTIONS}
    wall, started = time.time(), time.perf_counter()
    headers, lines = lean.post("/api/generate", body)
    return read_answer(headers, lines, wall, started)


# A process of its own that notes when each job's first chunk is published (as seen by a
# subscriber that does nothing else): the reference for the response side of a request.
MONITOR = """
import sys, time, redis
r = redis.Redis.from_url(sys.argv[1])
p = r.pubsub(ignore_subscribe_messages=True)
p.psubscribe(sys.argv[2] + "*")
seen = set()
with open(sys.argv[3], "a", buffering=1) as out:
    print("ready", file=out)
    for message in p.listen():
        t = time.time()
        channel = message["channel"].decode()
        if message["type"] == "pmessage" and channel not in seen:
            seen.add(channel)
            print(channel[len(sys.argv[2]):], t, file=out)
"""


def shares(
    pairs: list[tuple[Run, Run]], submitted: dict[str, float], published: dict[str, float]
) -> dict[str, Any]:
    """The gateway's own share of the added time to first token, per pair, leaving out the
    cluster's time between a job's submission and its first chunk (which varies by
    milliseconds from job to job and swamps a sub-millisecond difference): the request
    side (until the job is made) and the response side (from its first chunk's publication
    to the client's first line)."""
    request, response, both, cluster = [], [], [], []
    for a, b in pairs:
        if not all(r.job in submitted and r.job in published for r in (a, b)):
            continue
        req = (submitted[b.job] - b.started_at) - (submitted[a.job] - a.started_at)
        resp = (b.first_at - published[b.job]) - (a.first_at - published[a.job])
        between = (published[b.job] - submitted[b.job]) - (published[a.job] - submitted[a.job])
        request.append(req * 1000)
        response.append(resp * 1000)
        both.append((req + resp) * 1000)
        cluster.append(between * 1000)
    if not both:
        return {}
    return {
        "added_request_ms_p50": statistics.median(request),
        "added_response_ms_p50": statistics.median(response),
        "added_cluster_ms_p50": statistics.median(cluster),
        "added_ttft_own_ms_p50": statistics.median(both),
        "added_ttft_own_ms_p25": statistics.quantiles(both, n=4)[0] if len(both) > 1 else both[0],
        "added_ttft_own_ms_p75": statistics.quantiles(both, n=4)[2] if len(both) > 1 else both[0],
        "added_ttft_own_ms_ci95": median_ci(both),
    }


async def throughput(
    base: str, path: str, body: dict[str, Any], clients: int, seconds: float
) -> float:
    """Short requests per second: ``clients`` loops posting ``body`` to ``path``."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            (await http.post(path, json=body)).raise_for_status()
            done += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(one(http) for _ in range(clients)))
        return done / (time.perf_counter() - started)


def gateway_rps(base: str, model: str, seconds: float) -> dict[int, float]:
    body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False}
    body["options"] = {**OPTIONS, "num_predict": 1}
    return {n: asyncio.run(throughput(base, "/api/generate", body, n, seconds)) for n in LEVELS}


def server_rps(binary: str, model_file: Path, seconds: float) -> dict[int, float]:
    """The same short requests through llama-server's own HTTP server on the same file,
    with the worker's slots, context per slot, threads and flash attention (and every
    layer offloaded, as a GPU worker does; a CPU build ignores it)."""
    from batch_throughput import wait_http

    from scheduler.local.embedded import free_port
    from scheduler.settings import Settings
    from workers.cpus import default_thread_counts

    settings = Settings()
    one_token, batch = default_thread_counts()
    port = free_port()
    command = [binary, "-m", str(model_file), "--port", str(port), "--parallel", str(SLOTS)]
    command += ["-c", str(settings.num_ctx * SLOTS), "-t", str(one_token), "-tb", str(batch)]
    command += ["-ngl", "999", "-fa", "on" if settings.flash_attention else "off"]
    proc = subprocess.Popen(
        [*command, "--log-disable"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300)
        body = {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "seed": 1}
        body |= {"stream": False, "cache_prompt": False}
        base = f"http://127.0.0.1:{port}"
        return {n: asyncio.run(throughput(base, "/completion", body, n, seconds)) for n in LEVELS}
    finally:
        proc.terminate()
        proc.wait(30)


def print_rps(rps: dict[int, float], llama_rps: dict[int, float]) -> None:
    for n, value in rps.items():
        beside = ""
        if llama_rps:
            beside = f"   llama-server {llama_rps[n]:8.1f}   ratio {value / llama_rps[n]:.2f}"
        print(f"short requests/s through one gateway, {n:2} clients: {value:8.1f}{beside}")
    if not llama_rps:
        print("llama-server's own HTTP server: not measured (no binary given: --server PATH)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100, help="pairs measured")
    parser.add_argument("--seconds", type=float, default=5.0, help="per concurrency level")
    parser.add_argument("--model-file", type=Path, help="a GGUF file (default: the demo model)")
    parser.add_argument(
        "--server", help="a llama-server binary: its requests/s beside the gateway's"
    )
    args = parser.parse_args()

    from api_client import Client
    from scheduler.gguf.registry import demo_model_path
    from scheduler.local.embedded import free_port
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings
    from scheduler.store import keys
    from scheduler.store.acl import Role

    state = Path(tempfile.mkdtemp(prefix="ggufq-bench-"))
    (state / "models").mkdir()
    source = args.model_file or demo_model_path()
    model = source.stem
    (state / "models" / source.name).symlink_to(source.resolve())
    port = free_port()
    env = {
        "GGUFQ_STATE_DIR": str(state),
        "GGUFQ_MODELS_DIR": str(state / "models"),
        "GGUFQ_HTTP_PORT": str(port),
        "GGUFQ_NUM_PARALLEL": str(SLOTS),
    }
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    base = f"http://127.0.0.1:{port}"
    with LocalStack(settings, log_dir=state / "logs", extra_env=env) as stack:
        stack.add_process("gateway", "api_client.gateway", role=Role.GATEWAY)
        client = Client(stack.redis_url, settings=settings)
        http = httpx.Client(base_url=base, timeout=120)
        for _ in range(100):
            try:
                http.get("/")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        lean = Lean("127.0.0.1", port)
        arms = {
            "client": lambda: client_once(client, model),
            "httpx": lambda: gateway_once(http, model),
            "lean": lambda: lean_once(lean, model),
        }
        for _ in range(3):  # load and warm every arm
            for arm in arms.values():
                arm()
        notes = state / "published.txt"
        prefix = keys.job_channel("")
        monitor = subprocess.Popen([sys.executable, "-c", MONITOR, stack.redis_url, prefix, notes])
        while not notes.exists() or not notes.read_text().startswith("ready"):
            time.sleep(0.05)
        runs: dict[str, list[Run]] = {name: [] for name in arms}
        orders = list(itertools.permutations(arms))
        try:
            for i in range(args.requests):  # every order in turn: no arm always runs first
                for name in orders[i % len(orders)]:
                    runs[name].append(arms[name]())
        finally:
            monitor.terminate()
            monitor.wait()
        published = {
            job: float(t) for job, t in (row.split() for row in notes.read_text().splitlines()[1:])
        }
        jobs = [r.job for rows in runs.values() for r in rows]
        submitted = {
            j: float(v)
            for j, v in zip(jobs, client.r.mget([keys.job_submitted(j) for j in jobs]), strict=True)
            if v is not None
        }
        rps = gateway_rps(base, model, args.seconds)
        lean.close()
        http.close()
        client.close()
    shutil.rmtree(state, ignore_errors=True)
    # after the stack is gone, so that neither competes with the other for the cores
    llama_rps = server_rps(args.server, source, args.seconds) if args.server else {}

    print(f"model {model}, {args.requests} requests each way, every order of the arms in turn")
    httpx_added = report("httpx (the official clients' HTTP)", runs["client"], runs["httpx"])
    own = shares(list(zip(runs["client"], runs["httpx"], strict=True)), submitted, published)
    print_shares(own)
    lean_added = report("a lean HTTP client (bench's own)", runs["client"], runs["lean"])
    lean_own = shares(list(zip(runs["client"], runs["lean"], strict=True)), submitted, published)
    print_shares(lean_own)
    server = [r.server_ms for r in runs["httpx"] + runs["lean"] if r.server_ms is not None]
    server_p50 = statistics.median(server) if server else None
    if server:
        print(
            "the gateway process's own time before the first byte (its Server-Timing header: "
            f"request in until the job is made, first chunk until the answer begins): p50 "
            f"{server_p50:.3f} ms, p90 {statistics.quantiles(server, n=10)[-1]:.3f} ms"
        )
    print_rps(rps, llama_rps)
    print(
        json.dumps(
            {
                "bench": "gateway",
                "model": model,
                "requests": args.requests,
                "client_ttft_ms_p50": med(runs["client"], 0),
                "gateway_ttft_ms_p50": med(runs["httpx"], 0),
                "client_e2e_ms_p50": med(runs["client"], 1),
                "gateway_e2e_ms_p50": med(runs["httpx"], 1),
                "rps": {str(n): v for n, v in rps.items()},
                "server_rps": {str(n): v for n, v in llama_rps.items()},
                **httpx_added,
                "gateway_server_ms_p50": server_p50,
                **own,
                "lean": {**lean_added, **lean_own, "gateway_ttft_ms_p50": med(runs["lean"], 0)},
            }
        )
    )


def med(rows: list[Run], i: int) -> float:
    return statistics.median((r.ttft_s, r.e2e_s)[i] * 1000 for r in rows)


def report(label: str, direct: list[Run], via: list[Run]) -> dict[str, Any]:
    """Print and return what the gateway, read with one HTTP client, adds to the Python
    client: paired medians of time to first token and end to end, and the interval."""
    pairs = list(zip(direct, via, strict=True))
    ttft_diffs = [(b.ttft_s - a.ttft_s) * 1000 for a, b in pairs]
    e2e_diffs = [(b.e2e_s - a.e2e_s) * 1000 for a, b in pairs]
    added_ttft, added_e2e = statistics.median(ttft_diffs), statistics.median(e2e_diffs)
    ttft_q = statistics.quantiles(ttft_diffs, n=4)
    ttft_ci = median_ci(ttft_diffs)
    print(f"\nthe gateway read with {label}")
    print(f"{'':24}{'client':>10}{'gateway':>10}{'added':>10}")
    print(f"{'ttft p50 ms':24}{med(direct, 0):10.2f}{med(via, 0):10.2f}{added_ttft:10.2f}")
    print(f"{'end to end p50 ms':24}{med(direct, 1):10.2f}{med(via, 1):10.2f}{added_e2e:10.2f}")
    print("(added = paired median of gateway minus client)")
    print(f"added ttft quartiles ms: {ttft_q[0]:.2f} .. {ttft_q[2]:.2f}")
    print(
        f"added ttft p50, 95 % interval: {ttft_ci[0]:.2f} .. {ttft_ci[1]:.2f} ms "
        f"(target <= 2 ms: {against(ttft_ci, 2.0)})"
    )
    return {
        "added_ttft_ms_p50": added_ttft,
        "added_e2e_ms_p50": added_e2e,
        "added_ttft_ms_p25": ttft_q[0],
        "added_ttft_ms_p75": ttft_q[2],
        "added_ttft_ms_ci95": ttft_ci,
    }


def print_shares(own: dict[str, Any]) -> None:
    if not own:
        return
    print("the gateway's own share, the cluster's time from submission to first chunk")
    print("left out (paired medians, ms):")
    rows = [
        ("request side (HTTP in, until the job is made)", own["added_request_ms_p50"]),
        ("response side (first chunk, to the line read)", own["added_response_ms_p50"]),
        ("both, per pair", own["added_ttft_own_ms_p50"]),
    ]
    for label, value in rows:
        print(f"  {label:48}{value:8.2f}")
    print(
        f"  (quartiles of both: {own['added_ttft_own_ms_p25']:.2f} .. "
        f"{own['added_ttft_own_ms_p75']:.2f}; what was left out, submission to first "
        f"chunk, differs by {own['added_cluster_ms_p50']:.2f})"
    )
    low, high = own["added_ttft_own_ms_ci95"]
    print(f"  both, p50's 95 % interval: {low:.2f} .. {high:.2f} ms")


if __name__ == "__main__":
    main()

"""Added latency of the HTTP gateway over the Python client, on the same resident model.

The same short request both ways (raw prompt, 16 new tokens, greedy), interleaved ABBA so
that machine noise hits both alike: time to first token and end to end, and the paired
median of what the gateway adds (its process beside the stack, as `ggufq up` runs it; the
client side is httpx reading NDJSON). Then short requests per second through one gateway
process with 1, 8 and 32 concurrent clients. Prints a table, then one JSON line.

    python bench/gateway.py [--requests 100] [--model-file some.gguf]

On a small machine whose cores also run the model, the paired differences spread over
several milliseconds (a process that idled through the other side's request comes back
with cold caches); the quartiles printed beside the median say how far to trust it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

PROMPT = "The capital of France is"
OPTIONS = {"temperature": 0, "num_predict": 16, "seed": 1}


def client_once(client, model: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    first = None
    for _chunk in client.generate(model, PROMPT, stream=True, options=OPTIONS):
        if first is None:
            first = time.perf_counter()
    ended = time.perf_counter()
    return (first or ended) - started, ended - started


def gateway_once(http: httpx.Client, model: str) -> tuple[float, float]:
    body = {"model": model, "prompt": PROMPT, "raw": True, "options": OPTIONS}
    started = time.perf_counter()
    first = None
    with http.stream("POST", "/api/generate", json=body) as response:
        for line in response.iter_lines():
            if first is None and json.loads(line).get("response"):
                first = time.perf_counter()
    ended = time.perf_counter()
    return (first or ended) - started, ended - started


async def throughput(base: str, model: str, clients: int, seconds: float) -> float:
    body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False}
    body["options"] = {**OPTIONS, "num_predict": 1}
    done = 0
    deadline = time.perf_counter() + seconds

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            (await http.post("/api/generate", json=body)).raise_for_status()
            done += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(one(http) for _ in range(clients)))
        return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100, help="pairs measured")
    parser.add_argument("--seconds", type=float, default=5.0, help="per concurrency level")
    parser.add_argument("--model-file", type=Path, help="a GGUF file (default: the demo model)")
    args = parser.parse_args()

    from api_client import Client
    from scheduler.gguf.registry import demo_model_path
    from scheduler.local.embedded import free_port
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings

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
        "GGUFQ_NUM_PARALLEL": "8",
    }
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    base = f"http://127.0.0.1:{port}"
    with LocalStack(settings, log_dir=state / "logs", extra_env=env) as stack:
        stack.add_process("gateway", "api_client.gateway")
        client = Client(stack.redis_url, settings=settings)
        http = httpx.Client(base_url=base, timeout=120)
        for _ in range(100):
            try:
                http.get("/")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        for _ in range(3):  # load and warm both
            client_once(client, model)
            gateway_once(http, model)
        direct: list[tuple[float, float]] = []
        via: list[tuple[float, float]] = []
        for i in range(args.requests):  # ABBA order: neither side always runs second
            if i % 2:
                via.append(gateway_once(http, model))
                direct.append(client_once(client, model))
            else:
                direct.append(client_once(client, model))
                via.append(gateway_once(http, model))
        rps = {n: asyncio.run(throughput(base, model, n, args.seconds)) for n in (1, 8, 32)}
        http.close()
        client.close()
    shutil.rmtree(state, ignore_errors=True)

    def med(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] * 1000 for r in rows)

    pairs = list(zip(direct, via, strict=True))
    ttft_diffs = [(b[0] - a[0]) * 1000 for a, b in pairs]
    e2e_diffs = [(b[1] - a[1]) * 1000 for a, b in pairs]
    added_ttft, added_e2e = statistics.median(ttft_diffs), statistics.median(e2e_diffs)
    ttft_q = statistics.quantiles(ttft_diffs, n=4)
    print(f"model {model}, {args.requests} requests each way, interleaved ABBA")
    print(f"{'':24}{'client':>10}{'gateway':>10}{'added':>10}")
    print(f"{'ttft p50 ms':24}{med(direct, 0):10.2f}{med(via, 0):10.2f}{added_ttft:10.2f}")
    print(f"{'end to end p50 ms':24}{med(direct, 1):10.2f}{med(via, 1):10.2f}{added_e2e:10.2f}")
    print("(added = paired median of gateway minus client)")
    print(f"added ttft quartiles ms: {ttft_q[0]:.2f} .. {ttft_q[2]:.2f}")
    for n, value in rps.items():
        print(f"short requests/s through one gateway, {n:2} clients: {value:8.1f}")
    print("llama-server's own HTTP server: not measured (no binary given)")
    print(
        json.dumps(
            {
                "bench": "gateway",
                "model": model,
                "requests": args.requests,
                "client_ttft_ms_p50": med(direct, 0),
                "gateway_ttft_ms_p50": med(via, 0),
                "client_e2e_ms_p50": med(direct, 1),
                "gateway_e2e_ms_p50": med(via, 1),
                "rps": {str(n): v for n, v in rps.items()},
                "added_ttft_ms_p50": added_ttft,
                "added_e2e_ms_p50": added_e2e,
                "added_ttft_ms_p25": ttft_q[0],
                "added_ttft_ms_p75": ttft_q[2],
            }
        )
    )


if __name__ == "__main__":
    main()

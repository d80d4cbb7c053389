"""Server-side batches (OpenAI's Batch API on the gateway) against the client-side batch
(``Client.batch``) and the same lines as independent requests, on one stack in one run.

The lines share a few long system prompts, interleaved in input order (line i has prompt
i mod --prompts), as a batch of documents against a few instructions does. A server-side
batch runs its lines sorted so that those sharing a prefix run side by side; the other two
arms run them in input order. For each arm: tokens generated per second of wall time, and
the prompt tokens the runner computed (a prompt's tokens less those its slot's cache held,
``usage.prompt_tokens_details.cached_tokens``). Rounds alternate the arms' order; the table
gives each round, then the medians and the ratios the targets name (server-side tokens/s
over the client-side batch's, and the prompt tokens the affinity order saved against input
order). Prints the table, then one JSON line.

    python bench/batch_api.py [--lines 1000] [--prompts 8] [--system-words 90] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tinystack import tiny_state, wait_answering

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = "tiny"
MAX_TOKENS = 8


def lines_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    systems = [
        f"Instruction set {k}: "
        + " ".join(words[(k + n) % len(words)] for n in range(args.system_words))
        for k in range(args.prompts)
    ]
    return [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": f"{systems[i % args.prompts]}\nItem {i}:",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "seed": i,
            },
        }
        for i in range(args.lines)
    ]


def server_side(base: str, lines: list[dict[str, Any]]) -> dict[str, float]:
    import openai

    data = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
    with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=2) as api:
        started = time.perf_counter()
        upload = api.files.create(file=("bench.jsonl", data), purpose="batch")
        batch = api.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
            batch = api.batches.retrieve(batch.id)
        seconds = time.perf_counter() - started
        assert batch.status == "completed" and batch.output_file_id, batch
        out = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    usages = [x["response"]["body"]["usage"] for x in out]
    failed = len(lines) - len(out)
    return summary(usages, seconds, failed)


def summary(usages: list[dict[str, Any]], seconds: float, failed: int) -> dict[str, float]:
    tokens = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "prompt_tokens": prompt,
        "computed": prompt - cached,
        "failed": failed,
    }


def client_side(client: Any, lines: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    rows = [
        {
            "id": x["custom_id"],
            "prompt": x["body"]["prompt"],
            "options": {"seed": x["body"]["seed"]},
        }
        for x in lines
    ]
    options = {"num_predict": MAX_TOKENS, "temperature": 0}
    started = time.perf_counter()
    done = client.batch(MODEL, rows, options=options, concurrency=concurrency)
    seconds = time.perf_counter() - started
    usages = [
        {
            "completion_tokens": r["stats"]["eval_count"],
            "prompt_tokens": r["stats"]["prompt_eval_count"],
            "prompt_tokens_details": {"cached_tokens": 0},  # not in its rows
        }
        for r in done.rows
        if r["stats"]
    ]
    out = summary(usages, seconds, done.failed)
    out["computed"] = float("nan")
    return out


def independent(redis_url: str, settings: Any, lines: list[dict[str, Any]]) -> dict[str, float]:
    from api_client import AsyncClient

    async def main() -> dict[str, float]:
        async with AsyncClient(redis_url, settings=settings, timeout=600) as client:
            started = time.perf_counter()
            jobs = []
            for x in lines:  # in input order, all at once: placement keeps their order
                options = {"num_predict": MAX_TOKENS, "temperature": 0, "seed": x["body"]["seed"]}
                jobs.append(await client.submit(MODEL, x["body"]["prompt"], options=options))
            finals = await asyncio.gather(*(job.result() for job in jobs))
            seconds = time.perf_counter() - started
        usages = [
            {
                "completion_tokens": f.eval_count or 0,
                "prompt_tokens": f.prompt_eval_count or 0,
                "prompt_tokens_details": {"cached_tokens": f.prompt_cached_count or 0},
            }
            for f in finals
        ]
        return summary(usages, seconds, 0)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--system-words", type=int, default=90, help="words in each (~500 tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="the runner's parallel slots")
    parser.add_argument("--concurrency", type=int, default=16, help="lines in flight")
    args = parser.parse_args()

    from api_client import Client
    from scheduler.local.embedded import free_port
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings
    from scheduler.store.acl import Role

    state, tiny = tiny_state("ggufq-batch-bench-")
    tiny.write_tiny_llama(state / "models" / f"{MODEL}.gguf", context_length=8192)
    port = free_port()
    env = {
        "GGUFQ_MODELS_DIR": str(state / "models"),
        "GGUFQ_STATE_DIR": str(state),
        "GGUFQ_DATA_DIR": str(state / "data"),
        "GGUFQ_HTTP_PORT": str(port),
        "GGUFQ_NUM_PARALLEL": str(args.slots),
        "GGUFQ_NUM_CTX": "8192",
        "GGUFQ_MAX_REPLICAS": "1",
        "GGUFQ_MAX_QUEUE": "100000",
        "GGUFQ_METRICS_PORT": "0",
        "GGUFQ_BATCH_CONCURRENCY": str(args.concurrency),
    }
    os.environ.update(env)
    settings = Settings(redis_url=None, state_dir=state, models_dir=state / "models")
    lines = lines_of(args)
    arms = ("server-side", "client-side", "independent")
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with LocalStack(settings, ["--virtual-gpu", "8GiB"], state / "logs", env) as stack:
        stack.add_process("gateway", "api_client.gateway", role=Role.GATEWAY)
        base = f"http://127.0.0.1:{port}"
        wait_answering(base)
        ours = settings.model_copy(
            update={"redis_url": stack.redis_url, "data_dir": state / "data"}
        )
        with Client(stack.redis_url, settings=ours, timeout=600) as client:
            client.generate(MODEL, "warm up", options={"num_predict": 1})
            for n in range(args.rounds):
                order = arms if n % 2 == 0 else arms[::-1]
                for arm in order:
                    if arm == "server-side":
                        got = server_side(base, lines)
                    elif arm == "client-side":
                        got = client_side(client, lines, args.concurrency)
                    else:
                        got = independent(stack.redis_url, ours, lines)
                    results[arm].append(got)
                    print(
                        f"round {n + 1} {arm:<12} {got['seconds']:7.1f} s "
                        f"{got['tokens_per_s']:8.1f} tok/s  prompt {got['prompt_tokens']:8.0f}"
                        f"  computed {got['computed']:8.0f}  failed {got['failed']:.0f}",
                        flush=True,
                    )
    med = {
        arm: {
            k: statistics.median(r[k] for r in rows)
            for k in ("tokens_per_s", "computed", "prompt_tokens")
        }
        for arm, rows in results.items()
    }
    ratio = med["server-side"]["tokens_per_s"] / med["client-side"]["tokens_per_s"]
    saved = 1 - med["server-side"]["computed"] / med["independent"]["computed"]
    print()
    print(f"{'arm':<13}{'tok/s (median)':>16}{'prompt tokens':>15}{'computed':>10}")
    for arm in arms:
        m = med[arm]
        print(
            f"{arm:<13}{m['tokens_per_s']:>16.1f}{m['prompt_tokens']:>15.0f}{m['computed']:>10.0f}"
        )
    print(f"server-side / client-side tokens/s: {ratio:.3f} (target >= 0.95)")
    print(f"prompt tokens computed, sorted vs input order: {saved:.1%} fewer (target >= 40%)")
    print(
        json.dumps(
            {
                "bench": "batch_api",
                "lines": args.lines,
                "prompts": args.prompts,
                "rounds": args.rounds,
                "tokens_per_s": {arm: round(m["tokens_per_s"], 1) for arm, m in med.items()},
                "computed_prompt_tokens": {
                    "sorted": med["server-side"]["computed"],
                    "input_order": med["independent"]["computed"],
                },
                "server_over_client": round(ratio, 3),
                "prompt_tokens_saved": round(saved, 3),
            }
        )
    )


if __name__ == "__main__":
    main()

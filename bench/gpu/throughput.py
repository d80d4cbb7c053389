"""Throughput on the GPU: the whole system against direct llama-cpp-python and llama-server.

bench/batch_throughput.py's measurement (N prompts all at once, T new tokens each, greedy;
tokens/s over the wall time from the common start to the last job's end; time to first
token from that start) on a model given by path, every layer on the GPU, at several
parallel counts P (default 8, 32, 64: the issue's). Columns, each in a fresh process:

  sequential  llama-cpp-python's ``Llama.create_completion``, one prompt after the other,
              all layers on the GPU (the baseline: direct llama-cpp-python)
  engine      the worker's decode loop (``workers.engine.loop.Engine``) in-process, P slots
  system      the whole stack (client → placement → worker on the GPU → chunks over Redis)
              with GGUFQ_NUM_PARALLEL=P, one streaming client thread per prompt
  server      llama-server --parallel P -ngl all (--server PATH: one built from the same
              source with the same flags; bench/gpu/run.sh builds it)

Flash attention as GGUFQ_FLASH_ATTENTION says, for all four. Target (issue 20): system ≥ 0.9
× server at P = 32. Prints a table per P, then one JSON line.

    python bench/gpu/throughput.py --model M.gguf [--parallel 8,32,64] [--prompts 128]
                                   [--tokens 64] [--server PATH] [--skip sequential]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: batch_throughput
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project

import batch_throughput as bt  # noqa: E402

NUM_CTX = bt.NUM_CTX
MODEL = "bench-model"  # the name the system column serves the file under


def gpu_build() -> bool:
    """Whether llama.cpp here offloads to a GPU (else every column runs on the CPU)."""
    from workers.cpus import llama

    return bool(llama().llama_supports_gpu_offload())


def sequential(path: str, texts: list[str], tokens: int) -> bt.Run:
    from scheduler.settings import get_settings

    flash = get_settings().flash_attention
    return bt.sequential(path, texts, tokens, n_gpu_layers=-1, flash_attn=flash)


def engine(path: str, texts: list[str], tokens: int, parallel: int) -> bt.Run:
    from scheduler.protocol import Options, RunnerConfig
    from scheduler.settings import get_settings
    from workers.engine.loop import Engine

    config = RunnerConfig.for_generation(NUM_CTX, parallel, get_settings().flash_attention)
    loop = Engine(path, config, n_gpu_layers=-1, name="bench")
    options = Options(temperature=0, num_predict=tokens, repeat_penalty=1.0)
    loop.generate("Hello", Options(temperature=0, num_predict=4), lambda _t: None)  # warm

    def one(i: int, start: float) -> tuple[float, int, str]:
        first: list[float] = []

        def on_text(_text: str) -> None:
            if not first:
                first.append(time.perf_counter())

        stats = loop.generate(texts[i], options, on_text)
        return (first[0] if first else time.perf_counter()) - start, stats.eval_count, stats.text

    before = loop.times.copy()
    run = bt.all_at_once("engine", texts, one)
    spent = loop.times.since(before)
    python = (spent.step_ns - spent.decode_ns) / max(1, spent.step_ns)
    run.note = f"Engine, {parallel} slots, n_gpu_layers -1; python {python:.1%} of a step"
    loop.close()
    return run


def system(path: str, texts: list[str], tokens: int, parallel: int) -> bt.Run:
    from api_client import Client
    from scheduler.local.stack import LocalStack
    from scheduler.settings import Settings

    state = Path(tempfile.mkdtemp(prefix="ggufq-gpu-bench-"))
    models = state / "models"
    models.mkdir()
    (models / f"{MODEL}.gguf").symlink_to(path)
    env = {
        "GGUFQ_STATE_DIR": str(state),
        "GGUFQ_MODELS_DIR": str(models),
        "GGUFQ_NUM_PARALLEL": str(parallel),
        "GGUFQ_NUM_CTX": str(NUM_CTX),
        "GGUFQ_WORKER_THREADS": str(max(parallel * 2, len(texts) + 2)),
    }
    settings = Settings(
        redis_url=None, state_dir=state, models_dir=models, num_parallel=parallel, num_ctx=NUM_CTX
    )
    options = {"temperature": 0, "num_predict": tokens, "repeat_penalty": 1.0}
    with LocalStack(settings, log_dir=state / "logs", extra_env=env) as stack:
        client = Client(stack.redis_url, settings=settings, timeout=600)
        warm = client.generate(MODEL, "Hello", options={"temperature": 0, "num_predict": 4})
        if gpu_build() and not (warm.device or "").startswith("gpu:"):
            raise RuntimeError(f"the system column ran on {warm.device}, not on a GPU")

        def one(i: int, start: float) -> tuple[float, int, str]:
            first = None
            count, parts = 0, []
            for chunk in client.generate(MODEL, texts[i], stream=True, options=options):
                if first is None:
                    first = time.perf_counter()
                if chunk.done:
                    count = chunk.eval_count or 0
                else:
                    parts.append(chunk.response)
            return (first or time.perf_counter()) - start, count, "".join(parts)

        run = bt.all_at_once("system", texts, one)
        client.close()
    shutil.rmtree(state, ignore_errors=True)
    run.note = f"whole stack on {warm.device}, GGUFQ_NUM_PARALLEL={parallel}"
    return run


def server(binary: str, path: str, texts: list[str], tokens: int, parallel: int) -> bt.Run:
    from scheduler.settings import get_settings

    flash = "on" if get_settings().flash_attention else "off"
    extra = ("-ngl", "999", "-fa", flash)
    return bt.llama_server(binary, path, texts, tokens, parallel, extra, start_s=300)


def columns(args: argparse.Namespace, parallel: int) -> list[bt.Run]:
    path, texts, n = str(Path(args.model).resolve()), bt.prompts(args.prompts), args.tokens
    skip = set(filter(None, args.skip.split(",")))
    runs = []
    if "sequential" not in skip:
        runs.append(bt.fresh(sequential, path, texts, n))
    if "engine" not in skip:
        runs.append(bt.fresh(engine, path, texts, n, parallel))
    if "system" not in skip:
        runs.append(bt.fresh(system, path, texts, n, parallel))
    if args.server and "server" not in skip:
        runs.append(server(args.server, path, texts, n, parallel))
    return runs


def ratio(runs: list[bt.Run], name: str, against: str) -> float | None:
    by = {r.name: r for r in runs}
    return by[name].tok_s / by[against].tok_s if name in by and against in by else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a GGUF file (bench/gpu/make_model.py)")
    parser.add_argument("--parallel", default="8,32,64")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--server", help="a llama-server binary")
    parser.add_argument("--skip", default="", help="comma-separated columns to leave out")
    args = parser.parse_args()

    table: dict[int, list[bt.Run]] = {}
    for p in [int(x) for x in args.parallel.split(",") if x]:
        table[p] = columns(args, p)
        print(f"\nP = {p}: {args.prompts} prompts × {args.tokens} new tokens, greedy, at once")
        bt.print_round(table[p], argparse.Namespace(prompts=args.prompts, tokens=args.tokens))
    summary: dict[str, Any] = {}
    print(f"\n{'P':>4}{'column':>12}{'tok/s':>10}{'× seq':>8}{'× server':>10}{'TTFT p50':>10}")
    for p, runs in table.items():
        summary[str(p)] = {}
        for run in runs:
            vs_seq, vs_srv = ratio(runs, run.name, "sequential"), ratio(runs, run.name, "server")
            ttft = statistics.median(run.ttft_s)
            summary[str(p)][run.name] = {
                **run.summary(),
                "x_sequential": vs_seq,
                "x_server": vs_srv,
            }
            seq = f"{vs_seq:8.2f}" if vs_seq is not None else f"{'—':>8}"
            srv = f"{vs_srv:10.2f}" if vs_srv is not None else f"{'—':>10}"
            print(f"{p:4d}{run.name:>12}{run.tok_s:10.1f}{seq}{srv}{ttft:10.3f}")
    at32 = ratio(table.get(32, []), "system", "server")
    if at32 is not None:
        verdict = "met" if at32 >= 0.9 else "NOT met"
        print(f"target (system ≥ 0.9 × llama-server at P = 32): {at32:.2f}, {verdict}")
    print(
        json.dumps(
            {
                "bench": "gpu_throughput",
                "model": Path(args.model).name,
                "prompts": args.prompts,
                "tokens": args.tokens,
                "columns": summary,
                "system_x_server_at_32": at32,
                "target_met": None if at32 is None else at32 >= 0.9,
            }
        )
    )


if __name__ == "__main__":
    main()

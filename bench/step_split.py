"""The decode loop's time per step, split: llama_decode, sampling, bookkeeping, hand-over.

For each parallel count P (default 1, 4, 8) a fresh process loads the worker's engine
(``workers.engine.loop.Engine``) with P slots and the context placement loads
(``RunnerConfig.for_generation``, flash attention as GGUFQ_FLASH_ATTENTION says), then keeps
all P slots busy for ``--seconds``: P threads each run job after job (a short prompt, T new
tokens). Each job streams its text as a worker's does: ``workers.generation.Ticker`` →
``ChunkPublisher`` → the ``ChunkWriter`` thread into a private redis-server (``--no-redis``:
into nothing). The engine's own counters (``Engine.times``, ``StepTimes``) give the split:

  decode       llama_decode and the wait for its result (the model's own cost)
  sample       picking every sequence's next token
  stream       handing the step's tokens to the text relay (one put; it waits when the
               relay is workers/engine/relay.LAG steps behind)
  bookkeeping  the rest: admission, cancellation checks, batch layout, each token's piece,
               retiring jobs
  relay        not a step's: the text relay's own thread, beside the steps, making the
               jobs' text (characters, stop strings, on_text: the chunk publisher, a job's
               first chunk written to Redis), per step

"python" is a step's time outside llama_decode (sample + stream + bookkeeping) over the
whole step: the issue's target is at most 10 % on a GPU, where a step of a 1B model takes
a few milliseconds. ``--gil keep`` makes the short llama.cpp calls between decodes keep
the GIL, as a runner whose model is all on a GPU does (``auto``, the default; ``let-go``
the other way; workers/engine/gil.py says why not on the CPU); each row says which it had.
Prints a table, then one JSON line.

    python bench/step_split.py [--parallel 1,4,8] [--tokens 32] [--seconds 5]
                               [--model PATH|tiny] [--sampler greedy,greedy-device,default]
                               [--no-redis] [--gil auto|keep|let-go]

``--sampler`` takes several, a row each per P: ``greedy`` (plain greedy: numpy's argmax over
the logits on the host), ``greedy-device`` (the same jobs with GGUFQ_DEVICE_SAMPLING: the
argmax in llama_decode, llama.cpp's backend sampling, workers/engine/device_sampling.py),
``default`` (the default options: llama.cpp's chain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: batch_throughput

import batch_throughput as bt  # noqa: E402

if TYPE_CHECKING:
    from workers.engine.job import StepTimes

NUM_CTX = 2048
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip.",
    "Describe a market in the morning.",
    "What makes a good cup of tea?",
    "Tell me about the moon.",
    "Write a poem about a river.",
    "How does a bicycle stay upright?",
]


@dataclass
class Row:
    parallel: int
    jobs: int
    seconds: float
    times: StepTimes  # what the loop's counters added during the row
    sampler: str = "greedy"
    keeps_gil: bool = False  # the loop's short calls between decodes kept the GIL

    @property
    def steps(self) -> int:
        return self.times.steps

    def ms(self, ns: int) -> float:
        return ns / max(1, self.steps) / 1e6

    @property
    def python_share(self) -> float:
        return (self.times.step_ns - self.times.decode_ns) / max(1, self.times.step_ns)

    def summary(self) -> dict[str, Any]:
        t = self.times
        return {
            "sampler": self.sampler,
            "parallel": self.parallel,
            "jobs": self.jobs,
            "steps": t.steps,
            "tokens": t.tokens,
            "tokens_per_step": t.tokens / max(1, t.steps),
            "tok_s": t.tokens / self.seconds,
            "step_ms": self.ms(t.step_ns),
            "decode_ms": self.ms(t.decode_ns),
            "sample_ms": self.ms(t.sample_ns),
            "stream_ms": self.ms(t.emit_ns),
            "bookkeeping_ms": self.ms(t.bookkeeping_ns),
            "relay_ms": self.ms(t.relay_ns),
            "python_share": self.python_share,
            "keeps_gil": self.keeps_gil,
        }


def measure(
    path: str,
    parallel: int,
    tokens: int,
    seconds: float,
    sampler: str,
    redis_url: str | None,
    gpu_layers: int,
    keep_gil: bool | None = None,
) -> Row:
    """One row, in the calling process: load, warm, keep P slots busy, read the counters."""
    import redis

    from scheduler.protocol import Options, RunnerConfig
    from scheduler.settings import get_settings
    from workers.chunks import ChunkWriter
    from workers.engine.loop import Engine
    from workers.generation import Ticker
    from workers.publisher import ChunkPublisher

    settings = get_settings()
    config = RunnerConfig.for_generation(NUM_CTX, parallel, settings.flash_attention)
    engine = Engine(
        path,
        config,
        n_gpu_layers=gpu_layers,
        keep_gil=keep_gil,
        name=f"step-split-{parallel}",
        device_sampling=sampler == "greedy-device",
    )
    client = redis.Redis.from_url(redis_url) if redis_url else None
    writer = (
        ChunkWriter(client, settings.helper_nice, settings.stream_interval_s) if client else None
    )
    plain = sampler in ("greedy", "greedy-device")
    greedy = {"temperature": 0, "repeat_penalty": 1.0} if plain else {}
    options = Options(num_predict=tokens, seed=1, **greedy)  # type: ignore[arg-type]

    def job(prompt: str) -> None:
        if client is None:
            engine.generate(prompt, options, lambda _text: None)
            return
        publisher = ChunkPublisher(client, uuid.uuid4().hex, 600, writer)
        ticker = Ticker(lambda *_a, **_k: None, lambda text: publisher.publish({"response": text}))
        engine.generate(prompt, options, ticker)
        publisher.flush()  # as a worker does after a job, outside the decode loop

    job(PROMPTS[0])  # warm: the first step builds graphs
    done = [0] * parallel
    deadline = [0.0]

    def slot(i: int) -> None:
        n = 0
        while time.perf_counter() < deadline[0]:
            job(PROMPTS[(i + n * parallel) % len(PROMPTS)])
            n += 1
        done[i] = n

    before = engine.times.copy()
    started = time.perf_counter()
    deadline[0] = started + seconds
    threads = [threading.Thread(target=slot, args=(i,)) for i in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - started
    spent = engine.times.since(before)
    engine.close()
    if writer is not None:
        writer.close()
    kept = engine.keeps_gil
    return Row(
        parallel=parallel,
        jobs=sum(done),
        seconds=took,
        times=spent,
        sampler=sampler,
        keeps_gil=kept,
    )


def judged(row: Row) -> str:
    """The issue's target on one row: judged only at its scale, steps of 2-5 ms (a GPU's
    step of a 1B model): a shorter step makes the same Python a larger share."""
    step_ms = row.times.step_ns / max(1, row.steps) / 1e6
    if not 2.0 <= step_ms <= 5.0:
        return f"not judged (steps of {step_ms:.1f} ms, outside 2-5 ms)"
    return "met" if row.python_share <= 0.10 else "NOT met"


def fresh(*args: Any) -> Row:
    """A row in a new process (bench/batch_throughput.py's ``fresh`` says why)."""
    return bt.fresh(measure, *args)


def print_table(rows: list[Row]) -> None:
    head = ["P", "jobs", "steps", "tok/step", "tok/s", "step ms", "decode", "sample"]
    head += ["stream", "bookkeeping", "python", "relay"]
    print(
        f"{'sampler':<12}{head[0]:>3}{head[1]:>6}{head[2]:>7}{head[3]:>9}{head[4]:>8}{head[5]:>9}"
        f"{head[6]:>9}{head[7]:>8}{head[8]:>8}{head[9]:>12}{head[10]:>8}{head[11]:>8}"
    )
    for row in rows:
        s = row.summary()
        print(
            f"{row.sampler:<12}{row.parallel:3d}{row.jobs:6d}{row.steps:7d}{s['tokens_per_step']:9.2f}"
            f"{s['tok_s']:8.1f}{s['step_ms']:9.3f}{s['decode_ms']:9.3f}{s['sample_ms']:8.3f}"
            f"{s['stream_ms']:8.3f}{s['bookkeeping_ms']:12.3f}{row.python_share:8.1%}"
            f"{s['relay_ms']:8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parallel", default="1,4,8", help="comma-separated slot counts")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per job")
    parser.add_argument("--seconds", type=float, default=5.0, help="time each row runs")
    parser.add_argument(
        "--model",
        help="a GGUF file, or tiny (a generated tiny llama, --tiny-layers of width 128: "
        "steps of 2-5 ms at 32-64 sequences on a CPU); default: the demo model",
    )
    parser.add_argument(
        "--tiny-layers",
        type=int,
        default=4,
        help="layers of the tiny model: more for longer steps (4: 2.5 / 4.8 ms at 32 / 64 "
        "sequences on the 2-core machine; the model before, 2 layers of width 64: 1.0 / 1.8 "
        "ms)",
    )
    parser.add_argument(
        "--sampler",
        default="greedy",
        help="comma-separated: greedy (temperature 0, no penalties: numpy's argmax on the "
        "host), greedy-device (the same, the argmax in llama_decode: GGUFQ_DEVICE_SAMPLING), "
        "default (temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1: llama.cpp's chain)",
    )
    parser.add_argument("--no-redis", action="store_true", help="stream into nothing")
    parser.add_argument(
        "--gil",
        choices=("auto", "keep", "let-go"),
        default="auto",
        help="whether the loop's short llama.cpp calls between decodes keep the GIL: auto "
        "(as a runner has it: where every layer is on a GPU), keep, or let-go "
        "(workers/engine/gil.py)",
    )
    parser.add_argument(
        "--gpu-layers",
        type=int,
        default=-1,
        help="n_gpu_layers: -1 = all (none without a GPU build), 0 = the CPU only",
    )
    args = parser.parse_args()

    from scheduler.local.embedded import EmbeddedRedis

    if args.model == "tiny":  # the scale of a GPU step: a few ms at 32-64 sequences
        from tinystack import tiny_state

        state, tiny = tiny_state("ggufq-split-")
        shape = {"n_embd": 128, "n_ff": 256, "n_layer": args.tiny_layers}
        path = str(tiny.write_tiny_llama(state / "models" / "tiny.gguf", endless=True, **shape))
    elif args.model:
        path = str(Path(args.model).resolve())
    else:
        from scheduler.gguf.registry import demo_model_path

        path = str(demo_model_path())
    counts = [int(p) for p in args.parallel.split(",") if p]
    samplers = [x for x in args.sampler.split(",") if x]
    for sampler in samplers:
        if sampler not in ("greedy", "greedy-device", "default"):
            parser.error(f"--sampler {sampler!r}: greedy, greedy-device or default")
    server = None if args.no_redis else EmbeddedRedis(Path(tempfile.mkdtemp(prefix="ggufq-split-")))
    url = server.start() if server else None
    try:
        rows = []
        for p in counts:
            for sampler in samplers:
                rows.append(
                    fresh(
                        path,
                        p,
                        args.tokens,
                        args.seconds,
                        sampler,
                        url,
                        args.gpu_layers,
                        {"auto": None, "keep": True, "let-go": False}[args.gil],
                    )
                )
                row = rows[-1]
                print(f"P={p} {sampler}: {row.steps} steps in {row.seconds:.1f} s", flush=True)
    finally:
        if server:
            server.stop()
    print(
        f"\n{Path(path).name}, {args.tokens} new tokens a job, {args.sampler} sampling, "
        f"streams {'into Redis' if url else 'into nothing'}, {os.cpu_count()} cores, "
        f"GIL {'kept' if all(r.keeps_gil for r in rows) else 'let go'} in short calls "
        "between decodes; "
        "ms are per step (means), python = a step's time outside llama_decode, "
        "relay = the text relay's thread beside the steps"
    )
    print_table(rows)
    targets = {f"{r.sampler} P={r.parallel}": judged(r) for r in rows}
    print(
        "target (python ≤ 10 % of a step of 2-5 ms, the scale of a GPU's): "
        + ", ".join(f"{key} {verdict}" for key, verdict in targets.items())
    )
    print(
        json.dumps(
            {
                "bench": "step_split",
                "model": Path(path).name,
                "tokens": args.tokens,
                "seconds": args.seconds,
                "sampler": args.sampler,
                "redis": bool(url),
                "gpu_layers": args.gpu_layers,
                "gil": args.gil,
                "cores": os.cpu_count(),
                "rows": [r.summary() for r in rows],
                "python_share_le_10pct": targets,  # met, NOT met, or the step's scale
            }
        )
    )


if __name__ == "__main__":
    main()

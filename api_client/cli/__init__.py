"""`ggufq`: run the stack, send jobs, look at state."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.cluster import DeviceView, RunnerView
from scheduler.errors import GgufqError
from scheduler.settings import describe, get_settings
from scheduler.units import format_bytes, format_duration

if TYPE_CHECKING:  # the client (Celery, Redis) is imported only by the commands that use it
    from api_client import Client
    from api_client.batch import BatchSummary
    from scheduler.protocol import GenerateResponse


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GgufqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ggufq", description="GGUF models on a pool of GPUs.")
    sub = parser.add_subparsers(metavar="COMMAND")

    def command(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    from workers.main import add_worker_arguments

    p = command("up", cmd_up, "run the local stack in the foreground until Ctrl-C or SIGTERM")
    add_worker_arguments(p)
    p = command("demo", cmd_demo, "run example prompts through the demo model on a local stack")
    p.add_argument("--prompts", type=Path, help='a JSONL file of {"prompt": ...} rows')
    p = command(
        "run", cmd_run, "stream an answer; without a prompt, chat (lines from stdin, /bye ends)"
    )
    p.add_argument("model")
    p.add_argument("prompt", nargs="?", help="omit it for an interactive chat")
    _add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the final record as JSON")
    p.add_argument(
        "--verbose", action="store_true", help="print each answer's token counts and timings"
    )
    p = command(
        "batch", cmd_batch, "run a JSONL file of prompts or chats; one result row per input row"
    )
    p.add_argument("model")
    p.add_argument(
        "input", type=Path, help='JSONL: {"id", "prompt"} or {"id", "messages"} per line'
    )
    p.add_argument(
        "-O", "--output", type=Path, required=True, help="JSONL file of results, in input order"
    )
    _add_job_arguments(p)
    p.add_argument("--concurrency", type=int, default=8, help="jobs in flight at most (8)")
    p.add_argument(
        "--priority",
        choices=["batch", "interactive"],
        default="batch",
        help="batch (default): interactive work goes first",
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the rows already in --output, run the rest"
    )
    p.add_argument(
        "--retries", type=int, default=2, help="retries of transient failures per row (2)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON, no bar")
    command("config", cmd_config, "print the effective settings")
    p = command("models", cmd_models, "list the models jobs can name")
    p.add_argument("--json", action="store_true")
    p = command("estimate", cmd_estimate, "memory a model needs, per component and device")
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=None, help="num_ctx per sequence (default 4096)")
    p.add_argument("--parallel", type=int, default=1, help="num_parallel sequences")
    p.add_argument("--kv-type", default="f16", help="KV cache type: f16, q8_0, q4_0, ...")
    p.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="flash attention on or off (default: GGUFQ_FLASH_ATTENTION, as runners load)",
    )
    p.add_argument("--swa-full", action="store_true", help="full-size sliding-window cache")
    p.add_argument("--gpus", default="", help="free memory of the GPU, e.g. 24GiB (one GPU)")
    p.add_argument("--json", action="store_true", help="the same figures in bytes")
    p = command("load", cmd_load, "load a model ahead of use")
    p.add_argument("model")
    p.add_argument("--device", help="the device id to load it on (see `ggufq devices`)")
    p.add_argument("--keep-alive", help="how long it stays loaded when idle: 5m, 1h, -1 = forever")
    p = command("unload", cmd_unload, "unload a model (a busy runner when its last job ends)")
    p.add_argument("model")
    p = command("cancel", cmd_cancel, "cancel jobs (queued, parked or running)")
    p.add_argument("job_ids", nargs="+", metavar="JOB")
    p = command("jobs", cmd_jobs, "list jobs not ended: parked, queued, running, with position")
    p.add_argument("--json", action="store_true")
    p = command("ps", cmd_ps, "list the loaded models (runners)")
    p.add_argument("--json", action="store_true")
    p = command("devices", cmd_devices, "list the devices and their memory")
    p.add_argument("--json", action="store_true")
    p = command("worker", cmd_worker, "run a worker for this host's devices")
    add_worker_arguments(p)
    command("placement", cmd_placement, "run a placement service")
    p = command("flower", cmd_flower, "run Flower, the dashboard of workers, queues and jobs")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1", help="listen address (0.0.0.0: all)")
    p.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        help="further Flower options after --, e.g. -- --basic-auth=user:pass",
    )
    return parser


# -- stack -------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    from scheduler.local.stack import LocalStack

    settings = get_settings()
    stack = LocalStack(settings, worker_args=_worker_argv(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack.start()
    print(f"ggufq is up: Redis {stack.redis_url}; Ctrl-C stops it", flush=True)
    try:
        while not stop.wait(0.5):
            if not stack.alive():
                print("error: a stack process exited; stopping", file=sys.stderr)
                return 1
    finally:
        print("stopping ggufq ...", flush=True)
        stack.stop()
    return 0


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [f"--virtual-gpu={size}" for size in args.virtual_gpu]
    return argv + (["--cpu"] if args.cpu else [])


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import start_from_args

    start_from_args(args)
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    from scheduler.local.flower import run_flower

    extra = [a for a in args.flower_args if a != "--"]
    run_flower(get_settings(), args.port, args.address, extra)
    return 0


def cmd_placement(_args: argparse.Namespace) -> int:
    from scheduler.placement.service import main as placement_main

    placement_main([])
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from api_client.cli.demo import run_demo

    return run_demo(args.prompts)


# -- jobs --------------------------------------------------------------------------------
def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model option such as temperature=0 or num_predict=64 (repeatable)",
    )
    p.add_argument("--keep-alive", help="how long the model stays loaded after: 5m, 0, -1")


def cmd_run(args: argparse.Namespace) -> int:
    from api_client import Client

    options = dict(_parse_option(o) for o in args.option)
    if args.prompt is None:
        if args.json:
            raise GgufqError("--json needs a prompt: `ggufq run MODEL PROMPT --json`")
        return chat_loop(args.model, options, args.keep_alive, args.verbose)
    with Client() as client:
        final = None
        for chunk in client.generate(
            args.model, args.prompt, stream=True, options=options, keep_alive=args.keep_alive
        ):
            if chunk.done:
                final = chunk
            elif not args.json:
                print(chunk.response, end="", flush=True)
        if args.json and final is not None:
            print(final.model_dump_json())
        else:
            print()
        if args.verbose and final is not None:
            _print_stats(final)
    return 0


CHAT_HELP = "/bye (or Ctrl-D) ends the chat, /clear forgets the conversation"


def chat_loop(
    model: str, options: dict[str, Any], keep_alive: str | None, verbose: bool = False
) -> int:
    """`ggufq run MODEL`: a conversation, one line a turn, each answer streamed."""
    from api_client import Client

    interactive = sys.stdin.isatty()
    messages: list[dict[str, str]] = []
    warned: set[str] = set()
    with Client() as client:
        if interactive:
            print(f"Chatting with {model}; {CHAT_HELP}.")
        while True:
            try:
                line = input(">>> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:  # as Ollama: Ctrl-C at the prompt does not end the chat
                print(f"\n{CHAT_HELP}")
                continue
            text = line.strip()
            if text == "/bye":
                break
            if text == "/clear":
                messages.clear()
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            answer = _chat_turn(client, model, messages, options, keep_alive, verbose, warned)
            if answer is None:
                messages.pop()  # interrupted: the turn never happened
            else:
                messages.append({"role": "assistant", "content": answer})
    if interactive:
        print()
    return 0


def _chat_turn(
    client: Client,
    model: str,
    messages: list[dict[str, str]],
    options: dict[str, Any],
    keep_alive: str | None,
    verbose: bool,
    warned: set[str],
) -> str | None:
    """Stream one answer; None when Ctrl-C stopped it (and cancelled its job)."""
    parts: list[str] = []
    final = None
    turns = {"kind": "chat", "messages": messages}
    job = client.submit(model, options=options, keep_alive=keep_alive, extra=turns)
    try:
        for chunk in job.stream():
            if chunk.done:
                final = chunk
            else:
                parts.append(chunk.response)
                print(chunk.response, end="", flush=True)
    except KeyboardInterrupt:
        job.cancel()
        print()
        return None
    print(flush=True)
    if final is None:
        return "".join(parts)
    for warning in final.warnings:
        if warning not in warned:
            warned.add(warning)
            print(f"warning: {warning}", file=sys.stderr)
    if verbose:
        _print_stats(final)
    return final.message.content if final.message is not None else "".join(parts)


def _print_stats(final: GenerateResponse) -> None:
    """Ollama's `run --verbose` figures, on stderr so the answer stays clean on stdout."""
    eval_s = (final.eval_duration or 0) / 1e9
    prompt_s = (final.prompt_eval_duration or 0) / 1e9
    lines = [
        f"total duration:       {(final.total_duration or 0) / 1e6:.1f} ms",
        f"load duration:        {(final.load_duration or 0) / 1e6:.1f} ms",
        f"prompt eval count:    {final.prompt_eval_count or 0} token(s)",
        f"prompt eval duration: {prompt_s * 1e3:.1f} ms",
        f"eval count:           {final.eval_count or 0} token(s)",
        f"eval duration:        {eval_s * 1e3:.1f} ms",
    ]
    if eval_s > 0:
        lines.append(f"eval rate:            {(final.eval_count or 0) / eval_s:.2f} tokens/s")
    print("\n".join(lines), file=sys.stderr, flush=True)


def cmd_batch(args: argparse.Namespace) -> int:
    from api_client import Client

    options = dict(_parse_option(o) for o in args.option)
    kwargs: dict[str, Any] = dict(
        output=args.output,
        concurrency=args.concurrency,
        priority=args.priority,
        options=options,
        keep_alive=args.keep_alive,
        resume=args.resume,
        retries=args.retries,
    )
    summary: BatchSummary | None = None

    def seen(now: BatchSummary) -> None:
        nonlocal summary
        summary = now

    with Client() as client:
        try:
            if args.json:
                summary = client.batch(args.model, args.input, on_progress=seen, **kwargs)
            else:
                summary = _batch_with_bar(client, args, kwargs, seen)
        except KeyboardInterrupt:
            written = summary.finished if summary else 0
            print(
                f"interrupted: {written} rows are in {args.output}; the jobs in flight were "
                f"cancelled; run the same command with --resume to finish",
                file=sys.stderr,
            )
            return 130
    if args.json:
        print(json.dumps(summary.as_dict()))
    else:
        print(
            f"{summary.done} done, {summary.failed} failed, {summary.skipped} skipped; "
            f"{summary.tokens} tokens in {summary.seconds:.1f} s "
            f"({summary.tokens_per_s:.1f} tokens/s); rows in {args.output}"
        )
    if summary.failed:
        print(
            f"error: {summary.failed} of {summary.total} rows failed; their errors are in "
            f'{args.output} (rows whose "error" is not null)',
            file=sys.stderr,
        )
        return 1
    return 0


def _batch_with_bar(
    client: Client,
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    seen: Callable[[BatchSummary], None],
) -> BatchSummary:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), redirect_stdout=False) as bar:
        task = bar.add_task(f"{args.model}", total=None, counts="", rate="")

        def update(summary: BatchSummary) -> None:
            seen(summary)
            if bar.tasks[task].total is None:
                # the bar's rate and ETA count this run's rows only
                bar.update(task, total=summary.total - summary.skipped, completed=0)
            bar.update(
                task,
                completed=summary.done + summary.failed,
                counts=f"done {summary.done} failed {summary.failed}"
                + (f" skipped {summary.skipped}" if summary.skipped else ""),
                rate=f"{summary.tokens_per_s:.1f} tok/s",
            )

        return client.batch(args.model, args.input, on_progress=update, **kwargs)


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise GgufqError(f"option {text!r} must be KEY=VALUE, for example temperature=0")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


# -- listings ----------------------------------------------------------------------------
def cmd_config(_args: argparse.Namespace) -> int:
    rows = [(name, value, desc) for name, value, desc in describe(get_settings())]
    print_table(["SETTING", "VALUE", "DESCRIPTION"], rows)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from scheduler.gguf.metadata import format_params
    from scheduler.gguf.registry import Registry

    entries = Registry(get_settings().models_dir).entries()
    if args.json:
        out = [
            {
                "name": e.name,
                "path": str(e.path),
                "error": e.error,
                **(e.info.__dict__ if e.info else {}),
            }
            for e in entries
        ]
        print(json.dumps(out, indent=2))
        return 0
    rows = []
    for e in entries:
        if e.info is None:
            rows.append((e.name, "-", "-", "-", "-", f"unusable: {e.error}"))
            continue
        i = e.info
        rows.append(
            (
                e.name,
                format_bytes(i.file_size),
                i.architecture,
                f"{format_params(i.parameter_count)} {i.quantization}",
                str(i.context_length),
                "",
            )
        )
    print_table(["NAME", "SIZE", "ARCH", "PARAMS/QUANT", "CONTEXT", "NOTE"], rows)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from scheduler.gguf.estimate import choose_num_ctx, estimate, max_layers_that_fit
    from scheduler.gguf.registry import Registry
    from scheduler.protocol import RunnerConfig
    from scheduler.units import parse_bytes

    settings = get_settings()
    info = Registry(settings.models_dir).info(args.model)
    num_ctx, warning = choose_num_ctx(args.ctx, settings.num_ctx, info.context_length)
    cfg = RunnerConfig(
        num_ctx=num_ctx,
        num_parallel=args.parallel,
        kv_type=args.kv_type,
        flash_attn=settings.flash_attention if args.flash_attn is None else args.flash_attn,
        swa_full=args.swa_full,
    )
    gpus = [parse_bytes(g) for g in args.gpus.split(",") if g.strip()]
    if len(gpus) > 1:
        raise GgufqError(
            "--gpus takes one GPU for now; splitting a model across GPUs comes "
            "with the placement issue"
        )
    layers = max_layers_that_fit(info, cfg, gpus[0]) if gpus else 0
    est = estimate(info, cfg, num_gpu=layers)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "config": cfg.__dict__,
                    "n_gpu_layers": layers,
                    "block_count": info.block_count,
                    "warning": warning,
                    "devices": [dict(d.__dict__, total=d.total) for d in est.devices],
                    "kv_caches": [c.__dict__ for c in est.kv_caches],
                    "total": est.total,
                }
            )
        )
        return 0
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    rows = [
        [
            d.device,
            str(d.layers),
            *(format_bytes(v) for v in (d.weights, d.kv, d.compute, d.output, d.total)),
        ]
        for d in est.devices
    ]
    print_table(["DEVICE", "LAYERS", "WEIGHTS", "KV CACHE", "COMPUTE", "OUTPUT", "TOTAL"], rows)
    for c in est.kv_caches:
        kind = "sliding-window" if c.swa else "full"
        print(
            f"KV {kind}: {len(c.layers)} layers × {c.cells} cells × {c.streams} streams "
            f"({cfg.kv_type}) = {format_bytes(c.bytes)}"
        )
    if gpus:
        print(
            f"offload: {layers}/{info.block_count + 1} layers (output layer first) fit in "
            f"{format_bytes(gpus[0])}"
        )
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        result = client.load(args.model, device=args.device, keep_alive=args.keep_alive)
    ms = (result.load_duration or 0) / 1e6
    print(f"loaded {args.model} on {result.device} in {ms:.0f} ms")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        asked = client.unload(args.model)
    if not asked:
        print(f"{args.model} is not loaded")
    else:
        print(f"unloading {args.model}: {len(asked)} runner(s)")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        for job_id in args.job_ids:
            client.cancel(job_id)
            print(f"asked job {job_id} to cancel")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        rows = client.jobs()
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return 0
    table = [
        [
            r.id,
            r.model,
            r.state,
            str(r.position or ""),
            r.device or "",
            r.priority,
            format_duration(time.time() - r.submitted_at),
        ]
        for r in rows
    ]
    print_table(["JOB", "MODEL", "STATE", "POS", "DEVICE", "PRIORITY", "AGE"], table)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        runners = client.ps()
        devices = {d.id: d for d in client.devices()}
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in runners], indent=2))
        return 0
    print_table(*ps_table(runners, devices))
    return 0


def ps_table(
    runners: list[RunnerView], devices: dict[str, DeviceView]
) -> tuple[list[str], list[list[str]]]:
    now = time.time()
    rows: list[list[str]] = []
    for r in runners:
        kinds: set[str] = {devices[d].kind if d in devices else "cpu" for d in r.devices}
        until: str
        if r.state != "ready":
            until = r.state
        elif r.in_flight > 0:
            until = "busy"
        else:
            until = "forever" if r.expires_at < 0 else format_duration(max(0.0, r.expires_at - now))
        rows.append(
            [
                r.model,
                format_bytes(r.bytes),
                processor(r, kinds),
                ",".join(r.devices),
                str(r.context_length),
                str(r.num_parallel),
                until,
            ]
        )
    return ["NAME", "SIZE", "PROCESSOR", "DEVICES", "CONTEXT", "PARALLEL", "UNTIL"], rows


def processor(runner: RunnerView, kinds: set[str]) -> str:
    """Where a runner computes, as Ollama's ps says it: "100% GPU", "35%/65% CPU/GPU"."""
    if kinds <= {"cpu"}:
        return "100% CPU"
    if runner.n_gpu_layers < 0 or runner.size <= 0:
        return "100% GPU"
    gpu = round(100 * runner.bytes / runner.size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def cmd_devices(args: argparse.Namespace) -> int:
    from api_client import Client

    with Client() as client:
        devices = client.devices()
        runners = client.ps()
    if args.json:
        print(json.dumps([d.model_dump(mode="json") for d in devices], indent=2))
        return 0
    rows = []
    for d in devices:
        count = sum(1 for r in runners if d.id in r.devices)
        rows.append(
            (
                d.id,
                d.worker,
                d.name,
                format_bytes(d.total),
                format_bytes(d.reserved),
                format_bytes(d.free),
                str(count),
                "yes" if d.virtual else "no",
            )
        )
    print_table(["ID", "WORKER", "NAME", "TOTAL", "RESERVED", "FREE", "RUNNERS", "VIRTUAL"], rows)
    return 0


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row, strict=True)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    sys.exit(main())

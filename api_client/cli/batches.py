"""`ggufq batches`: batches that run on the cluster (OpenAI's Batch API lines), listed with
their progress, submitted from a file, looked at, cancelled, and their results read."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from api_client.batches.handle import BatchHandle, recent_batches
from api_client.cli.tables import print_table
from api_client.client import Client

BAR = 20


def bar(done: int, total: int) -> str:
    filled = round(BAR * done / total) if total else 0
    return "#" * filled + "." * (BAR - filled) + f" {done}/{total}"


def add_batches_commands(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(metavar="ACTION")
    submit = sub.add_parser("submit", help="start a batch from a JSONL file; returns at once")
    submit.add_argument("input", type=Path, help="OpenAI Batch API lines: custom_id, url, body")
    submit.add_argument("--endpoint", help="the lines' url (default: the first line's)")
    submit.add_argument("--window", default="24h", help="its completion window (24h)")
    submit.add_argument("--wait", action="store_true", help="wait for its end, with a bar")
    submit.set_defaults(func=cmd_submit)
    for name, func, what in (
        ("status", cmd_status, "print a batch as JSON (OpenAI's batch object)"),
        ("cancel", cmd_cancel_batch, "cancel a batch: its jobs stop, what ended is kept"),
        ("results", cmd_results, "print a batch's output and error lines, in input order"),
    ):
        q = sub.add_parser(name, help=what)
        q.add_argument("batch_id")
        q.set_defaults(func=func)
        if name == "results":
            q.add_argument("-O", "--output", type=Path, help="write them to this file")


def cmd_list(args: argparse.Namespace) -> int:
    with Client() as client:
        batches = recent_batches(client, args.limit)
    rows = []
    for batch in batches:
        total = batch.count("total")
        done = batch.count("completed") + batch.count("failed")
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(batch.doc["created_at"]))
        rows.append(
            [
                batch.id,
                batch.state.value,
                batch.doc["endpoint"],
                bar(done, total),
                str(batch.count("failed")),
                created,
            ]
        )
    if args.json:
        print(json.dumps([b.as_openai() for b in batches], indent=2))
    elif rows:
        print_table(["ID", "STATUS", "ENDPOINT", "PROGRESS", "FAILED", "CREATED"], rows)
    else:
        print("no batches (ggufq batches submit FILE starts one)")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    with Client() as client:
        handle = client.submit_batch(
            args.input, endpoint=args.endpoint, completion_window=args.window
        )
        print(handle.id)
        if not args.wait:
            return 0
        final = handle.wait(on_progress=_progress)
        print(file=sys.stderr)
    print(json.dumps(final["request_counts"]))
    return 0 if final["status"] == "completed" and not final["request_counts"]["failed"] else 1


def _progress(batch: dict[str, Any]) -> None:
    counts = batch["request_counts"]
    done = counts["completed"] + counts["failed"]
    print(f"\r{batch['status']:<12} {bar(done, counts['total'])}", end="", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    with Client() as client:
        print(json.dumps(BatchHandle(client, args.batch_id).status(), indent=2))
    return 0


def cmd_cancel_batch(args: argparse.Namespace) -> int:
    with Client() as client:
        print(BatchHandle(client, args.batch_id).cancel()["status"])
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    with Client() as client:
        lines = BatchHandle(client, args.batch_id).results()
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0

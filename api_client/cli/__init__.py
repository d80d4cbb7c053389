"""`ggufq`: run the stack, send jobs, look at state.

This module owns the parser and the dispatch; each command lives with its kind: jobs.py
(run, batch), batches.py (batches on the cluster), cluster.py (ps, devices, jobs, load,
unload, cancel), ops.py (up, worker, placement, flower, config, models, estimate),
gateway.py (serve, keys), access.py (acl), demo.py (demo).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import redis

from api_client.cli.access import add_acl_arguments, cmd_acl
from api_client.cli.batches import add_batches_commands, cmd_list
from api_client.cli.cluster import (
    cmd_cancel,
    cmd_devices,
    cmd_fsck,
    cmd_jobs,
    cmd_load,
    cmd_ps,
    cmd_unload,
    cmd_where,
)
from api_client.cli.demo import cmd_demo
from api_client.cli.gateway import add_keys_commands, add_serve_arguments, cmd_serve
from api_client.cli.jobs import Terminated, cmd_batch, cmd_run
from api_client.cli.ops import (
    cmd_config,
    cmd_estimate,
    cmd_flower,
    cmd_models,
    cmd_placement,
    cmd_up,
    cmd_worker,
)
from scheduler.errors import GgufqError
from scheduler.store.acl import refused
from scheduler.units import parse_bytes
from workers.args import add_worker_arguments

Command = Callable[[argparse.Namespace], int]


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
    except redis.exceptions.ResponseError as exc:
        if not refused(exc):
            raise
        print(
            f"error: Redis refused this to the user of GGUFQ_REDIS_URL ({exc}); run it as a "
            "user allowed to: `ggufq keys` as the administrator (REDIS_PASSWORD), the rest as "
            "placement, worker or gateway (README, Security)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM or SIGHUP where a command takes it so
        return exc.status if isinstance(exc, Terminated) else 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ggufq", description="GGUF models on a pool of GPUs.")
    sub = parser.add_subparsers(metavar="COMMAND")

    def command(name: str, func: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = command("up", cmd_up, "run the local stack in the foreground until Ctrl-C or SIGTERM")
    add_worker_arguments(p)
    p.add_argument(
        "--no-http", action="store_true", help="do not start the HTTP gateway (ggufq serve)"
    )
    p = command("serve", cmd_serve, "run the HTTP gateway: Ollama's API at /api, OpenAI's at /v1")
    add_serve_arguments(p)
    p = command("keys", lambda _a: 2, "manage the gateway's API keys: create, list, revoke")
    add_keys_commands(p)
    p = command("acl", cmd_acl, "make Redis ACL users, one per role, for a deployment")
    add_acl_arguments(p)
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
    p = command(
        "batches", cmd_list, "batches on the cluster: list, submit, status, cancel, results"
    )
    p.add_argument("--limit", type=int, default=20, help="the newest this many (20)")
    p.add_argument("--json", action="store_true")
    add_batches_commands(p)
    command("config", cmd_config, "print the effective settings")
    p = command("models", cmd_models, "list the models jobs can name")
    p.add_argument("--json", action="store_true")
    p = command("estimate", cmd_estimate, "memory a model needs, per component and device")
    p.add_argument("model")
    p.add_argument("--ctx", type=bounded(4, 1_048_576), help="num_ctx per sequence (default 4096)")
    p.add_argument("--parallel", type=bounded(1, 256), default=1, help="num_parallel sequences")
    p.add_argument("--kv-type", default="f16", help="KV cache type: f16, q8_0, q4_0, ...")
    p.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="flash attention on or off (default: GGUFQ_FLASH_ATTENTION, as runners load)",
    )
    p.add_argument("--swa-full", action="store_true", help="full-size sliding-window cache")
    p.add_argument(
        "--gpus", type=sizes, default=[], help="free memory of the GPU, e.g. 24GiB (one GPU)"
    )
    p.add_argument("--json", action="store_true", help="the same figures in bytes")
    p = command("load", cmd_load, "load a model ahead of use")
    p.add_argument("model")
    p.add_argument("--device", help="the device id to load it on (see `ggufq devices`)")
    p.add_argument("--keep-alive", help="how long it stays loaded when idle: 5m, 1h, -1 = forever")
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="keep this many copies loaded, one per device (kept until unloaded: keep_alive -1 "
        "unless --keep-alive says otherwise)",
    )
    p = command("unload", cmd_unload, "unload a model (a busy runner when its last job ends)")
    p.add_argument("model")
    p = command("cancel", cmd_cancel, "cancel jobs (queued, parked or running)")
    p.add_argument("job_ids", nargs="+", metavar="JOB")
    p = command("fsck", cmd_fsck, "check the cluster's state in Redis against its invariants")
    p.add_argument(
        "--settled",
        action="store_true",
        help="nothing runs or waits now: also report any job or counted slot left behind",
    )
    p.add_argument("--json", action="store_true")
    p = command("jobs", cmd_jobs, "list jobs not ended: parked, queued, running, with position")
    p.add_argument("--json", action="store_true")
    p = command("where", cmd_where, "where jobs are: their custody state, holder and epoch")
    p.add_argument("job_ids", nargs="+", metavar="JOB_ID")
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
        "--pool-url",
        default="",
        help="the gateway's pool page that Flower's bar links to (default: "
        "http://<GGUFQ_HTTP_HOST>:<GGUFQ_HTTP_PORT>/ui)",
    )
    p.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        help="further Flower options after --, e.g. -- --basic-auth=user:pass",
    )
    return parser


def bounded(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``."""

    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {low} to {high:,}")
        return value

    return number


def sizes(text: str) -> list[int]:
    """An argparse type: memory sizes, comma-separated (24GiB,8GB)."""
    try:
        return [parse_bytes(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


if __name__ == "__main__":
    sys.exit(main())

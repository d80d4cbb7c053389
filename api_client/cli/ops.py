"""The commands that run the stack's processes and inspect the setup: up, worker, placement,
flower, config, models, estimate."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from api_client.cli.tables import print_table
from scheduler.errors import GgufqError
from scheduler.gguf.estimate import (
    choose_num_ctx,
    estimate,
    estimate_bytes,
    first_batch_bytes,
    max_layers_that_fit,
)
from scheduler.gguf.metadata import format_params
from scheduler.gguf.registry import Registry
from scheduler.local.flower import run_flower
from scheduler.local.stack import LocalStack
from scheduler.placement.process import main as placement_main
from scheduler.protocol import RunnerConfig
from scheduler.redis_urls import masked
from scheduler.settings import describe, get_settings
from scheduler.store.acl import Role
from scheduler.units import format_bytes


# -- stack -------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    settings = get_settings()
    stack = LocalStack(settings, worker_args=_worker_argv(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack.start()
    where = ""
    if not args.no_http:
        stack.add_process("gateway", "api_client.gateway", role=Role.GATEWAY)
        where = f"; HTTP gateway on http://{settings.http_host}:{settings.http_port}"
    print(f"ggufq is up: Redis {masked(stack.redis_url)}{where}; Ctrl-C stops it", flush=True)
    try:
        while not stop.wait(0.5):
            stack.supervise()  # a child that died starts again: the stack serves on
    finally:
        print("stopping ggufq ...", flush=True)
        stack.stop()
    return 0


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [f"--virtual-gpu={size}" for size in args.virtual_gpu]
    return argv + (["--cpu"] if args.cpu else [])


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import start_from_args  # the worker runtime: `ggufq worker` only

    start_from_args(args)
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    extra = [a for a in args.flower_args if a != "--"]
    settings = get_settings()
    # Flower shows the Celery side; the pool's devices, runners and queues are the gateway's
    host = "localhost" if settings.http_host in ("127.0.0.1", "0.0.0.0") else settings.http_host
    pool_url = args.pool_url or f"http://{host}:{settings.http_port}/ui"
    print(f"the pool page (devices, runners, queues): {pool_url}", flush=True)
    run_flower(settings, args.port, args.address, extra, pool_url)
    return 0


def cmd_placement(_args: argparse.Namespace) -> int:
    placement_main([])
    return 0


# -- setup -------------------------------------------------------------------------------
def cmd_config(_args: argparse.Namespace) -> int:
    rows = [(name, value, desc) for name, value, desc in describe(get_settings())]
    print_table(["SETTING", "VALUE", "DESCRIPTION"], rows)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
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
    gpus: list[int] = args.gpus
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
                    "reserved_on_one_device": estimate_bytes(info, cfg),
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
    print(
        f"placement reserves {format_bytes(estimate_bytes(info, cfg))} for it on one device: "
        f"this and {format_bytes(first_batch_bytes(info, cfg))} a GPU holds after its first batch"
    )
    return 0

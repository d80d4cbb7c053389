"""The commands that look at and steer a running cluster: ps, devices, jobs, where, load,
unload, cancel, fsck."""

from __future__ import annotations

import argparse
import json
import sys
import time

from api_client.cli.tables import print_table, ps_table
from api_client.client import Client
from scheduler.custody import ENDED
from scheduler.store import fsck
from scheduler.store.clock import redis_now
from scheduler.units import format_bytes, format_duration


def cmd_load(args: argparse.Namespace) -> int:
    with Client() as client:
        result = client.load(
            args.model, device=args.device, keep_alive=args.keep_alive, replicas=args.replicas
        )
        replicas = [r for r in client.ps() if r.model == args.model]
    ms = (result.load_duration or 0) / 1e6
    print(f"loaded {args.model} on {result.device} in {ms:.0f} ms")
    if args.replicas:
        where = ", ".join(sorted(d for r in replicas for d in r.devices))
        print(f"{len(replicas)} replicas of {args.model} run on {where}")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    with Client() as client:
        asked = client.unload(args.model)
    if not asked:
        print(f"{args.model} is not loaded")
    else:
        print(f"unloading {args.model}: {len(asked)} runner(s)")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Ask each job to cancel, and say where it was: exit 1 when one is not known."""
    unknown = 0
    with Client() as client:
        for job_id in args.job_ids:
            client.cancel(job_id)
            view = client.custody(job_id)
            if view is None:
                unknown += 1
                print(
                    f"error: job {job_id} is not known to the cluster (a wrong id, or one that "
                    "ended over GGUFQ_STREAM_TTL_S ago); should it arrive, it is cancelled",
                    file=sys.stderr,
                )
            elif view.state in ENDED:
                print(f"job {job_id} had ended ({view.state}): nothing to cancel")
            else:
                print(f"asked job {job_id} to cancel ({view.state})")
    return 1 if unknown else 0


def cmd_jobs(args: argparse.Namespace) -> int:
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
            r.tenant,
            format_duration(time.time() - r.submitted_at),
        ]
        for r in rows
    ]
    print_table(["JOB", "MODEL", "STATE", "POS", "DEVICE", "PRIORITY", "TENANT", "AGE"], table)
    return 0


def cmd_where(args: argparse.Namespace) -> int:
    with Client() as client:
        views = [client.custody(job_id) for job_id in args.job_ids]
        now = redis_now(client.r)
    if args.json:
        print(json.dumps([v.model_dump(mode="json") if v else None for v in views], indent=2))
        return 0
    rows = [
        [v.id, v.state, v.holder or "-", str(v.epoch), format_duration(now - v.moved_at) + " ago"]
        if v
        else [job_id, "unknown: not placed yet, or ended long ago", "", "", ""]
        for job_id, v in zip(args.job_ids, views, strict=True)
    ]
    print_table(["JOB", "STATE", "HOLDER", "EPOCH", "MOVED"], rows)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    with Client() as client:
        runners = client.ps()
        devices = {d.id: d for d in client.devices()}
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in runners], indent=2))
        return 0
    print_table(*ps_table(runners, devices))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
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


def cmd_fsck(args: argparse.Namespace) -> int:
    """Check the cluster's state against its invariants (scheduler/store/fsck.py); exit 1
    when anything is wrong."""
    with Client() as client:
        census = fsck.read(client.r, client.streams.by_address())
    found = fsck.problems(census, settled=args.settled)
    jobs = {j for records in census.sent.values() for j in records}
    if args.json:
        print(json.dumps({"problems": [str(p) for p in found], "ok": not found}))
    else:
        for problem in found:
            print(problem)
        print(
            f"{len(census.devices)} devices, {len(census.runners)} runners, {len(jobs)} jobs "
            f"in flight, {len(census.parked)} parked: "
            + (f"{len(found)} problems" if found else "no problems")
        )
    return 1 if found else 0

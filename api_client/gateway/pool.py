"""What the pool page shows (``GET /api/pool``, drawn by ``/ui``): every device as a bar of
its memory (each runner's reservation, free, reported free), every runner (model, slots
busy of total, state, expiry, load progress), the jobs waiting by model and tenant with
the oldest wait, and the batches not ended. Pure: views in, one JSON-ready dict out.

A key that is not an admin sees the runners and jobs of its own models and tenant; the
memory other runners reserve is one "other" share of each bar, with no model named."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from scheduler.cluster import DeviceView, JobView, RunnerView


def pool_view(
    devices: list[DeviceView],
    runners: list[RunnerView],
    jobs: list[JobView],
    batches: list[dict[str, Any]],
    now: float,
    sees_model: Callable[[str], bool],
) -> dict[str, Any]:
    """The page's view; ``jobs`` and ``batches``: those the caller sees already."""
    shown = [r for r in runners if sees_model(r.model)]
    return {
        "now": now,
        "devices": [_device(d, runners, sees_model) for d in devices],
        "runners": [_runner(r, now) for r in shown],
        "queues": _queues(jobs, now),
        "batches": batches,
    }


def _device(
    device: DeviceView, runners: list[RunnerView], sees_model: Callable[[str], bool]
) -> dict[str, Any]:
    shares: list[dict[str, Any]] = []
    other = 0
    for runner in runners:
        reserved = runner.devices.get(device.id, 0)
        if not reserved:
            continue
        if sees_model(runner.model):
            shares.append({"runner": runner.id, "model": runner.model, "bytes": reserved})
        else:
            other += reserved
    if other:
        shares.append({"runner": "", "model": "other", "bytes": other})
    return {
        "id": device.id,
        "kind": device.kind,
        "virtual": device.virtual,
        "total": device.total,
        "reserved": device.reserved,
        "free": device.free,
        "reported_free": device.reported_free,
        "runners": shares,
    }


def _runner(runner: RunnerView, now: float) -> dict[str, Any]:
    expires_in = None if runner.expires_at < 0 else max(0.0, runner.expires_at - now)
    return {
        "id": runner.id,
        "model": runner.model,
        "state": runner.state,
        "devices": sorted(runner.devices),
        "busy": runner.in_flight,
        "slots": runner.num_parallel,
        "expires_in_s": expires_in,
        "load_progress": runner.load_progress,
    }


def _queues(jobs: list[JobView], now: float) -> list[dict[str, Any]]:
    """Jobs not running, by model and tenant: how many parked and queued, the oldest wait."""
    groups: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"parked": 0, "queued": 0, "oldest_wait_s": 0.0}
    )
    for job in jobs:
        if job.state == "running":
            continue
        group = groups[(job.model, job.tenant)]
        group[job.state] += 1
        group["oldest_wait_s"] = max(group["oldest_wait_s"], now - job.submitted_at)
    return [
        {"model": model, "tenant": tenant, **counts}
        for (model, tenant), counts in sorted(groups.items())
    ]

"""Redis hashes to typed records: the one place that knows how devices, runners and demand
are stored field by field."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from scheduler.cluster import DeviceState, DeviceView, RunnerState, RunnerView, decayed

log = logging.getLogger("ggufq.placement")


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decoded(h: dict[Any, Any]) -> dict[str, str]:
    """A hash as Redis returns it (bytes) with text keys and values."""
    return {text(k): text(v) for k, v in h.items()}


def device_from_hash(device_id: str, h: dict[str, str], reserved: int) -> DeviceState:
    return DeviceState(
        id=device_id,
        worker=h["worker"],
        queue=h["queue"],
        kind=h["kind"],  # type: ignore[arg-type]
        total=int(h["total"]),
        reported_free=int(h["free"]),
        reserved=reserved,
    )


def runner_from_hash(runner_id: str, h: dict[str, str]) -> RunnerState | None:
    if not h or "model" not in h:
        return None
    return RunnerState(
        id=runner_id,
        model=h["model"],
        config_key=h.get("config_key", ""),
        devices=_devices(h),
        state=h.get("state", "loading"),  # type: ignore[arg-type]
        in_flight=int(h.get("in_flight", 0)),
        expires_at=float(h.get("expires_at", -1)),
        last_used=float(h.get("last_used", 0)),
        num_parallel=int(h.get("num_parallel", 1)),
        n_gpu_layers=int(h.get("n_gpu_layers", -1)),
    )


def device_view(device_id: str, h: dict[str, str], reserved: int) -> DeviceView:
    return DeviceView(
        id=device_id,
        host=h.get("host", ""),
        worker=h.get("worker", ""),
        name=h.get("name", ""),
        kind=h.get("kind", "cpu"),
        total=int(h.get("total", 0)),
        reported_free=int(h.get("free", 0)),
        reserved=reserved,
        virtual=h.get("virtual") == "1",
        uuid=h.get("uuid", ""),
        queue=h.get("queue", ""),
        heartbeat=float(h.get("heartbeat", 0)),
    )


def runner_view(runner_id: str, h: dict[str, str]) -> RunnerView | None:
    if "model" not in h:
        return None
    loaded_at, load_progress = h.get("loaded_at"), h.get("load_progress")
    return RunnerView(
        id=runner_id,
        model=h["model"],
        state=h.get("state", "loading"),
        devices=_devices(h),
        bytes=int(h.get("bytes", 0)),
        size=int(h.get("total_bytes", h.get("bytes", 0))),
        context_length=int(h.get("num_ctx", 0)),
        num_parallel=int(h.get("num_parallel", 1)),
        n_gpu_layers=int(h.get("n_gpu_layers", -1)),
        block_count=int(h.get("block_count", 0)),
        embedding=h.get("embedding") == "1",
        in_flight=int(h.get("in_flight", 0)),
        keep_alive_s=float(h.get("keep_alive_s", 0)),
        expires_at=float(h.get("expires_at", -1)),
        last_used=float(h.get("last_used", 0)),
        loaded_at=None if loaded_at is None else float(loaded_at),
        worker=h.get("worker", ""),
        config_key=h.get("config_key", ""),
        load_progress=None if load_progress is None else float(load_progress),
    )


def decayed_demand(raw: dict[str, str], now: float) -> dict[str, float]:
    """The demand hash (model → "count:time") as counts decayed to ``now``; an entry
    that cannot be read counts as none (:func:`demand_of`)."""
    demand = {}
    for model, value in raw.items():
        found = demand_of(model, value, now)
        if found is not None:
            demand[model] = found
    return demand


_UNREADABLE: set[str] = set()  # models whose demand entry was warned about


def demand_of(model: str, value: str | bytes, now: float) -> float | None:
    """One entry of the demand hash ("count:time", as demand.lua writes it) decayed to
    ``now``; None, with one warning a model, when it is anything else, a count that is
    negative or not finite included (an eviction must not fail on it, nor rate every
    set alike: the model then counts as never asked for)."""
    try:
        score, last = text(value).split(":")
        count, at = float(score), float(last)
        if count >= 0 and math.isfinite(count) and math.isfinite(at):
            return decayed(count, at, now)
    except ValueError:  # UnicodeDecodeError included
        pass
    if model not in _UNREADABLE:
        _UNREADABLE.add(model)
        shown = value.decode(errors="replace") if isinstance(value, bytes) else value
        log.warning("model %r's demand %r cannot be read: none counted", model, shown)
    return None


def _devices(h: dict[str, str]) -> dict[str, int]:
    return {k: int(v) for k, v in json.loads(h.get("devices", "{}")).items()}

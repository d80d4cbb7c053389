"""Plain-text tables for the listings: column widths from the longest cell, no borders."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from scheduler.cluster import DeviceView, RunnerView
from scheduler.units import format_bytes, format_duration


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row, strict=True)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def ps_table(
    runners: list[RunnerView], devices: dict[str, DeviceView]
) -> tuple[list[str], list[list[str]]]:
    now = time.time()
    rows: list[list[str]] = []
    # replicas: runners of one model and configuration; each row says which of how many
    copies = Counter((r.model, r.config_key) for r in runners if r.state != "unloading")
    nth: Counter[tuple[str, str]] = Counter()
    for r in runners:
        nth[(r.model, r.config_key)] += 1
        of = copies[(r.model, r.config_key)]
        replica = f"{nth[(r.model, r.config_key)]}/{of}" if of > 1 else ""
        kinds: set[str] = {devices[d].kind if d in devices else "cpu" for d in r.devices}
        until: str
        if r.state == "loading" and r.load_progress is not None:
            until = f"loading {r.load_progress:.0%}"
        elif r.state != "ready":
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
                f"{r.in_flight}",
                replica,
                until,
            ]
        )
    head = ["NAME", "SIZE", "PROCESSOR", "DEVICES", "CONTEXT", "PARALLEL", "JOBS", "REPLICA"]
    return [*head, "UNTIL"], rows


def processor(runner: RunnerView, kinds: set[str]) -> str:
    """Where a runner computes, as Ollama's ps says it: "100% GPU", "35%/65% CPU/GPU"."""
    if kinds <= {"cpu"}:
        return "100% CPU"
    if runner.n_gpu_layers < 0 or runner.size <= 0:
        return "100% GPU"
    gpu = round(100 * runner.bytes / runner.size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"

"""The cluster's counters and histograms in Redis (``ggufq:stats``, ``ggufq:timings``):
workers add to them as jobs end and models load or unload; placement's metrics endpoint
reports them, so any placement service reports the same totals."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.store import keys

# the counters workers keep in ggufq:stats, as "<name>|<model>" fields
COUNTERS = {
    "finished": ("ggufq_jobs_finished", "Jobs that ended with a result."),
    "failed": ("ggufq_jobs_failed", "Jobs that ended with an error."),
    "cancelled": ("ggufq_jobs_cancelled", "Jobs that were cancelled."),
    "tokens": ("ggufq_tokens_generated", "Tokens generated."),
    "prompt_tokens": ("ggufq_prompt_tokens", "Prompt tokens evaluated."),
    "loads": ("ggufq_model_loads", "Models loaded into a runner."),
    "load_seconds": ("ggufq_model_load_seconds", "Time spent loading models, in seconds."),
    "evictions": ("ggufq_model_evictions", "Idle runners unloaded to make room for a job."),
    "expiries": ("ggufq_model_expiries", "Runners unloaded as their keep_alive ran out."),
    "unloads": ("ggufq_model_unloads", "Runners unloaded on request (ggufq unload)."),
}


def count(pipe: Any, model: str, **amounts: float) -> None:
    """Queue additions to the cluster's counters on a pipeline (the caller executes it)."""
    for name, amount in amounts.items():
        if amount:
            pipe.hincrbyfloat(keys.STATS, f"{name}|{model}", amount)


_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class Timing:
    """One histogram: its Prometheus name and help, its labels (the model last: a model
    name may hold any character) and its buckets' upper bounds."""

    metric: str
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]


TIMINGS = {
    "queue_wait": Timing(
        "ggufq_job_queue_wait_seconds",
        "From a job's submission to its slot on a runner: parked, queued and loading time.",
        ("tenant", "model"),
        _SECONDS,
    ),
    "ttft": Timing(
        "ggufq_job_time_to_first_token_seconds",
        "From a job's submission to its first token.",
        ("model",),
        _SECONDS,
    ),
    "tokens_per_s": Timing(
        "ggufq_job_tokens_per_second",
        "A finished job's generation speed: tokens generated over the time generating them.",
        ("model",),
        (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
    ),
}


def job_timings(
    submitted_at: float, hops: Mapping[str, float], final: Mapping[str, Any]
) -> dict[str, float]:
    """A finished job's timings from its hops (scheduler/store/hops.py, wall-clock seconds
    of the hosts that noted them: clamped at 0 where clocks disagree) and its final record."""
    out = {}
    for name, hop in (("queue_wait", "admitted"), ("ttft", "first_token")):
        if hops.get(hop):
            out[name] = max(0.0, hops[hop] - submitted_at)
    tokens, ns = final.get("eval_count") or 0, final.get("eval_duration") or 0
    if tokens > 1 and ns > 0:
        out["tokens_per_s"] = tokens / (ns / 1e9)
    return out


def observe(pipe: Any, labels: Mapping[str, str], **values: float) -> None:
    """Queue observations of the named timings on a pipeline (the caller executes it);
    ``labels`` holds each timing's labels, by name."""
    for name, value in values.items():
        timing = TIMINGS[name]
        tail = "|".join(labels[label] for label in timing.labels)
        bucket = bisect_left(timing.buckets, value)  # len(buckets): +Inf
        pipe.hincrby(keys.TIMINGS, f"{name}|{bucket}|{tail}", 1)
        pipe.hincrbyfloat(keys.TIMINGS, f"{name}|sum|{tail}", value)


@dataclass
class Histogram:
    """One timing's series for one set of labels: cumulative bucket counts and the sum."""

    name: str
    labels: tuple[str, ...]
    counts: list[int]
    total: float = 0.0

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus's cumulative buckets, ``+Inf`` last."""
        bounds = [str(b) for b in TIMINGS[self.name].buckets] + ["+Inf"]
        running, out = 0, []
        for bound, n in zip(bounds, self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


def histograms(raw: Mapping[bytes, bytes]) -> Iterator[Histogram]:
    """The histograms in ``ggufq:timings`` as read whole; fields it does not know (an
    older or newer writer's) are skipped."""
    found: dict[tuple[str, tuple[str, ...]], Histogram] = {}
    for field, value in raw.items():
        name, _, rest = field.decode().partition("|")
        timing = TIMINGS.get(name)
        if timing is None:
            continue
        bucket, *labels = rest.split("|", len(timing.labels))
        if len(labels) != len(timing.labels):
            continue
        key = (name, tuple(labels))
        if key not in found:
            found[key] = Histogram(name, key[1], [0] * (len(timing.buckets) + 1))
        hist = found[key]
        if bucket == "sum":
            hist.total = float(value)
        elif bucket.isdigit() and int(bucket) < len(hist.counts):
            hist.counts[int(bucket)] = int(value)
    yield from found.values()

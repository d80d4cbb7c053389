"""The cluster's counters and histograms in Redis (``ggufq:stats``, ``ggufq:timings``):
workers add to them as jobs end and models load or unload; placement's metrics endpoint
reports them, so any placement service reports the same totals."""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from scheduler.store import keys

log = logging.getLogger(__name__)

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
    "breakdowns": (
        "ggufq_model_breakdowns",
        "Runners unloaded because their decode loop stopped on a bug.",
    ),
}


def execute(pipe: Any, what: str) -> None:
    """Execute a pipeline of counters and timings: a command Redis refuses (a value it
    cannot add, a key of another type) is logged, never raised, for what it counts has
    happened (a job that ended is not failed by its counting). Redis away still raises."""
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, Exception):
            log.warning("%s: Redis refused a counter (%s)", what, reply)


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
    of the hosts that noted them: clamped at 0 where clocks disagree) and its final record.
    Nothing for a job that went on elsewhere mid-answer: its run's hops and rate are not the
    job's."""
    out: dict[str, float] = {}
    if final.get("resumed"):
        return out
    for name, hop in (("queue_wait", "admitted"), ("ttft", "first_token")):
        if hops.get(hop):
            out[name] = max(0.0, hops[hop] - submitted_at)
    tokens, ns = final.get("eval_count") or 0, final.get("eval_duration") or 0
    if tokens > 1 and ns > 0:
        out["tokens_per_s"] = tokens / (ns / 1e9)
    return out


def observe(pipe: Any, labels: Mapping[str, str], **values: float) -> None:
    """Queue observations of the named timings on a pipeline (the caller executes it);
    ``labels`` holds each timing's labels, by name. A value that is no finite number of
    0 or more is left out (Redis would refuse it)."""
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            continue
        timing = TIMINGS[name]
        tail = "|".join(labels[label] for label in timing.labels)
        i = bisect_left(timing.buckets, value)
        bound = _bound(timing.buckets[i]) if i < len(timing.buckets) else "+Inf"
        pipe.hincrby(keys.TIMINGS, f"{name}|{bound}|{tail}", 1)
        pipe.hincrbyfloat(keys.TIMINGS, f"{name}|sum|{tail}", value)


def _bound(upper: float) -> str:
    """A bucket's upper bound as its field and its ``le`` label name it."""
    return repr(float(upper))


@dataclass
class Histogram:
    """One timing's series for one set of labels: cumulative bucket counts and the sum."""

    name: str
    labels: tuple[str, ...]
    counts: list[int]
    total: float = 0.0

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus's cumulative buckets, ``+Inf`` last."""
        running, out = 0, []
        for bound, n in zip(_index(TIMINGS[self.name]), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


def histograms(raw: Mapping[bytes, bytes]) -> Iterator[Histogram]:
    """The histograms in ``ggufq:timings`` as read whole. A field is kept by its bucket's
    bound, so a version with other bounds skips the counts it does not know, as it skips
    an unknown timing or anything it cannot read: a scrape never fails on them."""
    found: dict[tuple[str, tuple[str, ...]], Histogram] = {}
    for field, value in raw.items():
        try:
            name, bound, labels, number = _field(field, value)
        except (ValueError, UnicodeDecodeError):
            continue
        timing = TIMINGS[name]
        hist = found.get((name, labels))
        if hist is None:
            hist = found[(name, labels)] = Histogram(name, labels, [0] * (len(timing.buckets) + 1))
        if bound == "sum":
            hist.total = number
        else:
            hist.counts[_index(timing)[bound]] = int(number)
    yield from found.values()


def _field(field: bytes, value: bytes) -> tuple[str, str, tuple[str, ...], float]:
    """(timing, bound or "sum", labels, value) of one field; ValueError when it is not one."""
    name, _, rest = field.decode().partition("|")
    timing = TIMINGS.get(name)
    if timing is None:
        raise ValueError(f"no timing {name!r}")
    bound, *labels = rest.split("|", len(timing.labels))
    if len(labels) != len(timing.labels) or (bound != "sum" and bound not in _index(timing)):
        raise ValueError(f"not a field of {name}: {field!r}")
    number = float(value)
    if not math.isfinite(number) or (bound != "sum" and not number.is_integer()):
        raise ValueError(f"not a count: {value!r}")
    return name, bound, tuple(labels), number


@cache
def _index(timing: Timing) -> dict[str, int]:
    """Each bound's place among the timing's buckets, ``+Inf`` last."""
    bounds = [_bound(b) for b in timing.buckets] + ["+Inf"]
    return {bound: i for i, bound in enumerate(bounds)}

"""The cluster's counters in Redis (``ggufq:stats``): workers add to them as jobs end and
models load; placement's metrics endpoint reports them."""

from __future__ import annotations

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
}


def count(pipe: Any, model: str, **amounts: float) -> None:
    """Queue additions to the cluster's counters on a pipeline (the caller executes it)."""
    for name, amount in amounts.items():
        if amount:
            pipe.hincrbyfloat(keys.STATS, f"{name}|{model}", amount)

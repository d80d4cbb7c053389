"""A runner: one llama.cpp model and context, resident between jobs.

Up to ``num_parallel`` jobs run at once on it, batched by one decode loop
(``workers.engine``); more wait in arrival order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler.estimate import RunnerConfig
from scheduler.protocol import Options
from workers.engine import GGML_KV_TYPES, Engine, Format, GenerationStats

__all__ = ["GGML_KV_TYPES", "GenerationStats", "Runner"]


class Runner:
    def __init__(
        self,
        runner_id: str,
        model: str,
        path: str,
        config: RunnerConfig,
        device_ids: list[str],
        n_gpu_layers: int,
        n_threads: int | None,
        keep_alive_s: float,
        load_timeout_s: float = 300.0,
        split: list[float] | None = None,
    ) -> None:
        self.id = runner_id
        self.model = model
        self.config = config
        self.device_ids = device_ids
        self.keep_alive_s = keep_alive_s
        started = time.perf_counter_ns()
        # Exactly the context the estimator sized (scheduler.estimate.context_sizes).
        self.engine = Engine(
            path,
            config,
            n_gpu_layers=n_gpu_layers,
            n_threads=n_threads,
            name=model,
            load_timeout_s=load_timeout_s,
            split=split,
        )
        self.load_duration_ns = time.perf_counter_ns() - started

    def generate(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool] = lambda: False,
        format: Format = None,
    ) -> GenerationStats:
        """Run one job to its end; safe to call from many threads at once.

        ``on_text`` is called from the runner's decode thread with each new piece of
        text: it must be cheap and must not block. ``cancelled`` is polled every decode
        step; a cancelled job ends with done_reason "cancel".
        """
        return self.engine.generate(prompt, options, on_text, cancelled, format)

    def close(self) -> None:
        """Unload: running and waiting jobs end with JobFailed."""
        self.engine.close()

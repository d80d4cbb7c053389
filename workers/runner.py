"""A runner: one llama.cpp model and context, resident between jobs.

Up to ``num_parallel`` jobs run at once on it, batched by one decode loop
(``workers.engine.loop``); more wait in arrival order.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.protocol import Options, RunnerConfig
from workers.engine.job import Share
from workers.engine.loop import Engine
from workers.engine.sampling import Format
from workers.engine.text import GenerationStats
from workers.resident import Resident


class Runner(Resident):
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
        device_sampling: bool = False,
        on_load: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__(runner_id, model, config, device_ids, keep_alive_s)
        # Exactly the context the estimator sized (scheduler.gguf.estimate.context_sizes).
        self.engine = self.timed_load(
            lambda: Engine(
                path,
                config,
                n_gpu_layers=n_gpu_layers,
                n_threads=n_threads,
                name=model,
                load_timeout_s=load_timeout_s,
                split=split,
                device_sampling=device_sampling,
                on_load=on_load,
            )
        )

    def generate(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool] = lambda: False,
        format: Format = None,
        share: Share = ("default", "interactive", 1.0),
        meanwhile: Callable[[], None] = lambda: None,
        answer: list[int] | None = None,
    ) -> GenerationStats:
        """Run one job to its end; safe to call from many threads at once.

        ``on_text`` is called from the runner's text relay thread with each new piece of
        text: it must be cheap and must not block (workers/engine/relay.py). ``cancelled``
        is polled every decode step; a cancelled job ends with done_reason "cancel".
        ``meanwhile()`` runs in this thread once the job is queued; ``answer`` gets each
        sampled token, and holds a resumed job's answer so far (:meth:`Engine.generate`).
        """
        args = (prompt, options, on_text, cancelled, format, share, meanwhile, answer)
        return self.engine.generate(*args)

    @property
    def stopped(self) -> str | None:
        return self.engine.stopped

    def close(self) -> None:
        """Unload: running and waiting jobs end with JobFailed."""
        self.engine.close()

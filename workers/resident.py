"""What every resident model in a worker has, whatever it serves (generation or
embeddings): its runner id, model, configuration, devices, keep_alive and load time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from scheduler.protocol import RunnerConfig

T = TypeVar("T")


class Resident:
    def __init__(
        self,
        runner_id: str,
        model: str,
        config: RunnerConfig,
        device_ids: list[str],
        keep_alive_s: float,
    ) -> None:
        self.id = runner_id
        self.model = model
        self.config = config
        self.device_ids = device_ids
        self.keep_alive_s = keep_alive_s
        self.load_duration_ns = 0

    @property
    def stopped(self) -> str | None:
        """Why it can serve no more jobs though loaded (its decode loop stopped on a bug);
        None while it serves."""
        return None

    def timed_load(self, load: Callable[[], T]) -> T:
        """Run the load, recording how long it took (Ollama's load_duration)."""
        started = time.perf_counter_ns()
        loaded = load()
        self.load_duration_ns = time.perf_counter_ns() - started
        return loaded

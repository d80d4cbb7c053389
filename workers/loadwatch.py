"""A model load's progress clock: it gives up when the load shows no progress for a while.

llama.cpp reports load progress through a callback whose False return aborts the load;
this decides that answer. Pure, with an injected clock: a load that keeps progressing
may take as long as it needs, one that stalls for ``timeout_s`` is abandoned.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LoadWatch:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.last_progress = clock()
        self.fraction = 0.0
        self.stalled_s = 0.0

    def progress(self, fraction: float) -> bool:
        """Called by llama.cpp; False aborts the load."""
        now = self.clock()
        stalled = now - self.last_progress
        if stalled > self.timeout_s:
            self.stalled_s = stalled
            return False
        if fraction > self.fraction:
            self.fraction, self.last_progress = fraction, now
        return True

    def describe(self) -> str:
        return (
            f"the load made no progress for {self.stalled_s:.0f} s at {self.fraction:.0%} "
            f"(GGUFQ_LOAD_TIMEOUT_S is {self.timeout_s:g} s); check the model's storage, "
            "or raise the timeout"
        )

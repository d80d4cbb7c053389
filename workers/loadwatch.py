"""A model load's progress clock: it gives up when the load shows no progress for a while,
and passes the progress on to whoever shows it.

llama.cpp reports load progress through a callback whose False return aborts the load;
this decides that answer. Pure, with an injected clock: a load that keeps progressing
may take as long as it needs, one that stalls for ``timeout_s`` is abandoned. ``report``
(the worker writes the fraction on the runner's record, for /api/ps and the clients that
wait) hears the first progress, then at most one change every ``REPORT_EVERY_S``, and
the end (1.0) always: a load makes thousands of callbacks, a record needs a few writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LoadWatch:
    REPORT_EVERY_S = 0.25

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[float], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.report = report
        self.last_progress = clock()
        self.fraction = 0.0
        self.stalled_s = 0.0
        self.reported: tuple[float, float] | None = None  # (fraction, when) last reported

    def progress(self, fraction: float) -> bool:
        """Called by llama.cpp; False aborts the load."""
        now = self.clock()
        stalled = now - self.last_progress
        if stalled > self.timeout_s:
            self.stalled_s = stalled
            return False
        if fraction > self.fraction:
            self.fraction, self.last_progress = fraction, now
            if self.report is not None and self._due(now):
                self.reported = (self.fraction, now)
                self.report(self.fraction)
        return True

    def _due(self, now: float) -> bool:
        if self.reported is None or self.fraction >= 1.0:
            return True
        return now - self.reported[1] >= self.REPORT_EVERY_S

    def describe(self) -> str:
        return (
            f"the load made no progress for {self.stalled_s:.0f} s at {self.fraction:.0%} "
            f"(GGUFQ_LOAD_TIMEOUT_S is {self.timeout_s:g} s); check the model's storage, "
            "or raise the timeout"
        )

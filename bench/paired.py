"""How far to trust a paired median on a noisy machine: a bootstrap interval for it.

The benches judge their targets on the median of per-pair differences (A and B run one
after the other). On a small machine whose cores also run the model those differences
spread over several milliseconds, so one run's median moves by about a millisecond from
run to run; the interval printed beside it says how much, and whether a target is met
(the whole interval under it), missed (the whole interval over it) or at the line.
"""

from __future__ import annotations

import random
import statistics


def median_ci(values: list[float], level: float = 0.95, resamples: int = 2000) -> list[float]:
    """The percentile bootstrap interval of the median of ``values``: [low, high]."""
    rng = random.Random(1)  # the same interval for the same numbers
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return [medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]]


def against(interval: list[float], target: float) -> str:
    """Where an interval stands against an upper target."""
    low, high = interval
    if high <= target:
        return "met"
    if low > target:
        return "NOT met"
    return "at the line"

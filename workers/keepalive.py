"""When idle runners expire. Pure: every function takes ``now``."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


def effective_keep_alive(requested_s: float | None, current_s: float) -> float:
    """A request that omits keep_alive keeps the runner's value; an explicit one replaces it."""
    return current_s if requested_s is None else requested_s


def expires_at(now: float, keep_alive_s: float) -> float | None:
    """When an idle runner unloads: None = never (negative keep_alive)."""
    return None if keep_alive_s < 0 else now + keep_alive_s


@dataclass
class ExpirySchedule:
    """Runner id → expiry time, with the next due one at hand. Not thread-safe by itself."""

    _heap: list[tuple[float, int, str]] = field(default_factory=list)
    _current: dict[str, tuple[float, int]] = field(default_factory=dict)
    _counter: int = 0

    def set(self, runner_id: str, at: float | None) -> None:
        if at is None:
            self._current.pop(runner_id, None)
            return
        self._counter += 1
        self._current[runner_id] = (at, self._counter)
        heapq.heappush(self._heap, (at, self._counter, runner_id))

    def cancel(self, runner_id: str) -> None:
        self._current.pop(runner_id, None)

    def next_at(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[str]:
        due = []
        self._drop_stale()
        while self._heap and self._heap[0][0] <= now:
            at, counter, runner_id = heapq.heappop(self._heap)
            if self._current.get(runner_id) == (at, counter):
                del self._current[runner_id]
                due.append(runner_id)
            self._drop_stale()
        return due

    def _drop_stale(self) -> None:
        while self._heap:
            at, counter, runner_id = self._heap[0]
            if self._current.get(runner_id) == (at, counter):
                return
            heapq.heappop(self._heap)

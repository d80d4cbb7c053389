"""Background loops that never die silently. Each step runs under a guard that catches
everything, logs it, backs off and goes on; a loop that keeps failing is reported through
:class:`LoopHealth`, which each process publishes with its heartbeat (health checks read it).
Pure threading: no Redis here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ggufq.loops")
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # after 1, 2, ... failures in a row
EXPECTED_RETRY_S = 0.5  # the longest pause after an expected failure (Redis away)


class LoopHealth:
    """Which loops of this process are failing, since when, and why."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, tuple[float, str]] = {}

    def ok(self, name: str) -> None:
        with self._lock:
            self._failing.pop(name, None)

    def failed(self, name: str, error: str, now: float) -> None:
        with self._lock:
            since = self._failing.get(name, (now, ""))[0]
            self._failing[name] = (since, error)

    def failing(self, now: float, longer_than_s: float) -> dict[str, str]:
        """Loops failing without a success for more than ``longer_than_s``: name → error."""
        with self._lock:
            return {
                name: error
                for name, (since, error) in self._failing.items()
                if now - since > longer_than_s
            }

    def describe(self, now: float, longer_than_s: float, writer: str = "") -> str:
        """One line for a health record: "" when healthy. ``writer``, the loop writing the
        record, is left out: it works, since it writes (before, its first beat after Redis
        came back said it was failing, and read unhealthy until the next beat)."""
        failing = self.failing(now, longer_than_s)
        failing.pop(writer, None)
        return "; ".join(f"{name}: {error}" for name, error in sorted(failing.items()))


def run_loop(
    name: str,
    step: Callable[[], object],
    stop: threading.Event,
    health: LoopHealth,
    every_s: float = 0.0,
    expected: tuple[type[Exception], ...] = (),
    clock: Callable[[], float] = time.monotonic,
    backoff_s: tuple[float, ...] = BACKOFF_S,
) -> None:
    """Call ``step`` until ``stop`` is set, ``every_s`` apart (0: again at once, for a step
    that waits by itself; a step that never returns, such as a pub/sub listener, reports
    ``health.ok(name)`` itself as it goes, or it would stay "failing" after one error).
    A failure is logged (``expected`` kinds, such as Redis being away, without a
    traceback) and retried after a back-off (for ``expected`` kinds, at most half a
    second: a loop that failed only while Redis was away succeeds, and reads healthy,
    within a heartbeat of its return); the loop itself never ends on one."""
    errors = 0
    while not stop.is_set():
        try:
            step()
        except Exception as exc:
            errors += 1
            health.failed(name, f"{type(exc).__name__}: {exc}", clock())
            pause = backoff_s[min(errors, len(backoff_s)) - 1]
            if isinstance(exc, expected):
                # Redis away: try at least once a beat, so the loop is back soon after it
                pause = min(pause, EXPECTED_RETRY_S)
                if errors == 1 or errors % 20 == 0:
                    log.warning("%s: %s (%d in a row)", name, exc, errors)
            else:
                log.exception("%s failed (%d in a row); it goes on", name, errors)
            stop.wait(pause)
            continue
        errors = 0
        health.ok(name)
        if every_s:
            stop.wait(every_s)


def start_loop(
    name: str,
    step: Callable[[], object],
    stop: threading.Event,
    health: LoopHealth,
    every_s: float = 0.0,
    expected: tuple[type[Exception], ...] = (),
) -> threading.Thread:
    """:func:`run_loop` in a daemon thread named ``ggufq-<name>``."""
    thread = threading.Thread(
        target=run_loop,
        args=(name, step, stop, health, every_s, expected),
        name=f"ggufq-{name}",
        daemon=True,
    )
    thread.start()
    return thread


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel an asyncio background task and wait for it to end (what it raised is its
    own loop's to log: it is over)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task

"""Model loads as the gateway's waiting clients see them: Ollama-style ``load_progress``.

A runner's worker writes its load's fraction on the runner's record as llama.cpp reports
it (``workers.residency``). A model is *loading* for a client when it has a runner
loading and none ready: a job of that model can only be waiting for the load then (with a
ready runner it runs, or waits for a slot, and a replica's load says nothing of it).

:class:`LoadBoard` reads the runners for all of a gateway's waiting answers at once, at
most every ``LOOK_S``, and only while some answer asks: thousands of clients waiting on
one load cost one read a half second, not one each. A read Redis misses keeps what was
known (a keep-alive goes out instead of a progress line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from redis.exceptions import RedisError

from scheduler.cluster import RunnerView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadProgress:
    """How far a model's load has come. ``stage``: ``waiting`` (its worker has not begun
    reading the weights: it is starting, or loading another model first), ``loading``
    (the weights, ``fraction`` of them read) or ``starting`` (weights in, the context
    being made)."""

    model: str
    stage: str
    fraction: float
    runner: str
    seconds_left: float | None = None  # at the pace so far, when it has one

    def shown(self) -> tuple[str, float]:
        """What a client sees move: its stage and fraction (not the time left)."""
        return self.stage, round(self.fraction, 3)

    def body(self) -> dict[str, object]:
        """The ``load_progress`` object of a line, a /api/ps row or a 503's body."""
        out: dict[str, object] = {"stage": self.stage, "fraction": round(self.fraction, 3)}
        if self.seconds_left is not None:
            out["seconds_left"] = round(self.seconds_left, 1)
        return out

    def retry_after_s(self) -> int:
        """What a 503 asks the client to wait: the time left at the pace so far (1 to 60
        seconds), or 5 without a pace."""
        if self.seconds_left is None:
            return 5
        return max(1, min(60, math.ceil(round(self.seconds_left, 1))))


def progress_of(runner: RunnerView) -> LoadProgress:
    """A loading runner's progress as its record says (no pace: that takes two reads)."""
    if runner.load_progress is None:
        return LoadProgress(runner.model, "waiting", 0.0, runner.id)
    fraction = min(runner.load_progress, 1.0)
    stage = "starting" if fraction >= 1.0 else "loading"
    return LoadProgress(runner.model, stage, fraction, runner.id)


class LoadBoard:
    """The models whose only live runners are loading, with their progress."""

    LOOK_S = 0.5
    FORGET_S = 3.0

    def __init__(
        self,
        read: Callable[[], Awaitable[list[RunnerView]]],
        clock: Callable[[], float] = lambda: asyncio.get_running_loop().time(),
    ) -> None:
        self._read, self._clock = read, clock
        self._loading: dict[str, LoadProgress] = {}
        self._first_seen: dict[str, tuple[float, float]] = {}  # runner → (when, fraction)
        self._read_at = self._read_ok_at = -math.inf
        self._reading: asyncio.Future[None] | None = None
        self.version = 0  # raised whenever what a client would see changed
        self._watchers = 0
        self._looking: asyncio.Future[None] | None = None

    def known(self, model: str) -> LoadProgress | None:
        """What the last read said of ``model`` (None: not loading, not read yet, or read
        too long ago: reads that fail forget what they knew)."""
        if self._clock() - self._read_ok_at > self.FORGET_S:
            return None
        return self._loading.get(model)

    def look(self) -> None:
        """Read again, in the background, unless a read is under way or recent."""
        if self._reading is None and self._clock() - self._read_at >= self.LOOK_S:
            self._reading = asyncio.ensure_future(self._refresh())

    def watch(self) -> None:
        """An answer waits for its first chunk: read every ``LOOK_S`` while any does."""
        self._watchers += 1
        if self._looking is None or self._looking.done():
            self._looking = asyncio.ensure_future(self._keep_looking())

    def unwatch(self) -> None:
        self._watchers -= 1

    async def _keep_looking(self) -> None:
        while self._watchers > 0:
            self.look()
            if self._reading is not None:
                await asyncio.shield(self._reading)
            await asyncio.sleep(self.LOOK_S)

    async def close(self) -> None:
        """Stop looking (the app stops)."""
        for task in (self._looking, self._reading):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def of(self, model: str) -> LoadProgress | None:
        """``model``'s load, read again first unless the last read is recent."""
        self.look()
        if self._reading is not None:
            await asyncio.shield(self._reading)
        return self.known(model)

    async def now(self, model: str) -> LoadProgress | None:
        """``model``'s load as a read begun after this call says (None if it fails)."""
        asked = self._clock()
        while self._read_at < asked or self._reading is not None:
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._reading)
        return self.known(model) if self._read_ok_at >= asked else None

    async def _refresh(self) -> None:
        begun = self._clock()
        try:
            loading = self._tally(await self._read())
        except (RedisError, OSError) as exc:  # Redis away: keep-alives go out instead
            log.debug("runners not read for load progress: %s", exc)
            return
        except Exception:  # a fault of ours: said, and the next look tries again
            log.exception("the load board's read failed")
            return
        finally:
            self._read_at, self._reading = begun, None
        if {m: p.shown() for m, p in loading.items()} != {
            m: p.shown() for m, p in self._loading.items()
        }:
            self.version += 1
        self._loading, self._read_ok_at = loading, begun

    def _tally(self, runners: list[RunnerView]) -> dict[str, LoadProgress]:
        now = self._clock()
        ready = {r.model for r in runners if r.state == "ready"}
        loading: dict[str, LoadProgress] = {}
        seen: dict[str, tuple[float, float]] = {}
        for runner in runners:
            if runner.state != "loading" or runner.model in ready:
                continue
            found = progress_of(runner)
            if found.stage == "loading":  # the pace from its first read seen loading
                fraction = found.fraction
                first = seen[runner.id] = self._first_seen.get(runner.id, (now, fraction))
                pace = (fraction - first[1]) / (now - first[0]) if now > first[0] else 0.0
                if pace > 0:
                    found = replace(found, seconds_left=(1.0 - fraction) / pace)
            best = loading.get(runner.model)
            if best is None or found.fraction > best.fraction:
                loading[runner.model] = found
        self._first_seen = seen
        return loading

"""Runs Redis says this worker has and it does not have.

Redis that comes back from an older state (a crash that lost its last second of writes, a
restore from a snapshot) can hold a job this worker ended as still in flight on its device,
marked running, its runner counting it: its end was lost with the rest, its final chunk
too. Nothing would ever end it, and its runner would stay busy for good. Every other
heartbeat (a loop of its own) the worker reads its devices' started jobs; one that no run
here holds (nor one whose end is being written), at two looks at least ``min_age_s``
apart, with no end of this worker's waiting for Redis, is a stray. Its end is written again
when this process wrote it in the last two minutes (its final chunk, or its hand-back); else it
is handed back to placement in one step (lua/end.lua: no chunk, record gone, counted off,
among the orphans), which re-places it once if nothing was streamed or fails it saying
what happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from scheduler.protocol import Placement, SentJob
from scheduler.store.worker_state import WorkerState

log = logging.getLogger(__name__)
Run = tuple[str, str]  # (job id, placement id)
Last = tuple[int, dict[str, Any] | None]  # (seq, last chunk: None writes none)
End = tuple[Last, SentJob | None]  # its last chunk, and its orphan record when handed back
WriteEnd = Callable[[Placement, str, Last, SentJob | None], object]
# the ends kept to be written again (at most this many, this long): a stray is found
# within two looks 10 s apart
ENDS_KEPT, ENDS_KEPT_S = 4096, 120.0
ENDS_WAIT_S = 10.0  # a job that comes again waits this long at most for its end on its way


class Strays:
    def __init__(
        self,
        state: WorkerState,
        device_ids: list[str],
        runs_here: Callable[[], set[Run]],
        ends_waiting: Callable[[], bool],
        write_end: WriteEnd,
        min_age_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state, self.device_ids = state, device_ids
        self.runs_here, self.ends_waiting, self.write_end = runs_here, ends_waiting, write_end
        self.min_age_s, self.clock = min_age_s, clock
        self._first_seen: dict[Run, float] = {}  # strays seen at an earlier look, and when
        self._lock = threading.Lock()
        self._kept: OrderedDict[Run, tuple[float, End]] = OrderedDict()  # run -> (at, end)
        self._finals: dict[str, Run] = {}  # job id -> its kept run that wrote a final chunk
        self._on_the_way: Counter[str] = Counter()  # job id -> its ends queued, not landed

    def on_its_way(self, job_id: str, write: Callable[[], None]) -> Callable[[], None]:
        """``write`` (an end of ``job_id``, for Redis now or after an outage), with the end
        counted as on its way until it ran (:meth:`end_again` waits for it)."""
        with self._lock:
            self._on_the_way[job_id] += 1

        def landing() -> None:
            write()
            with self._lock:
                self._on_the_way[job_id] -= 1
                if self._on_the_way[job_id] <= 0:
                    del self._on_the_way[job_id]

        return landing

    def keep(self, run: Run, done: Last, orphan: SentJob | None, fenced: bool = False) -> None:
        """Remember an end this process wrote (its last chunk, or its hand-back); one the
        custody fence refused (the job was taken from this run) is not its job's end."""
        now = self.clock()
        with self._lock:
            self._kept[run] = (now, (done, orphan))
            if orphan is None and done[1] is not None and not fenced:
                self._finals[run[0]] = run
            kept = self._kept
            while kept and (
                len(kept) > ENDS_KEPT or next(iter(kept.values()))[0] < now - ENDS_KEPT_S
            ):
                (job_id, _placement), _ = kept.popitem(last=False)
                if self._finals.get(job_id) not in kept:
                    self._finals.pop(job_id, None)

    def end_again(self, placement: Placement, job_id: str) -> bool:
        """Write again, under ``placement``, the end of a run of ``job_id`` this process
        ended lately, instead of running it a second time: Redis came back from before that
        end (and the run's start claim, or its send): its message came again, or it was
        placed again. Its hand-back is written again only for the same placement (a job
        handed back is placed again, to run). False when there is no such end. An end of
        the job still waiting for Redis (an outage, most often, comes before a restore)
        lands first, for at most ENDS_WAIT_S: it is what this looks for, and it goes before
        it in order; a job with none on its way never waits."""
        waited = time.monotonic() + ENDS_WAIT_S
        while job_id in self._on_the_way and time.monotonic() < waited:
            time.sleep(0.05)
        with self._lock:
            run = (job_id, placement.id)
            kept = self._kept.get(run) or self._kept.get(self._finals.get(job_id, run))
        if kept is None or kept[0] < self.clock() - ENDS_KEPT_S:
            return False
        log.warning("job %s ended here already: writing its end again, not running it", job_id)
        _at, (done, orphan) = kept
        self.write_end(placement, job_id, done, orphan)
        return True

    def _end_again(self, record: SentJob) -> None:
        """Write a stray's end again when this process wrote it lately, else give it back
        to placement (no chunk, among the orphans)."""
        run = (record.job.id, record.placement.id)
        why = (
            f"Redis holds it as running on {record.placement.device_id}, whose worker has no "
            "run of it (Redis lost the run's records, or came back from an older state)"
        )
        gone = record.model_copy(update={"lost": why})
        with self._lock:
            _at, (done, orphan) = self._kept.get(run, (0.0, ((0, None), gone)))
        what = "writing its end again" if orphan is not gone else "handing it back"
        log.warning("job %s: %s", record.job.id, what)
        self.write_end(record.placement, record.job.id, done, orphan)

    def look(self) -> int:
        """Hand back the started jobs no run here holds, seen so at an earlier look at least
        ``min_age_s`` ago; returns how many."""
        if self.ends_waiting():  # an end Redis missed is on its way: its record is not stray
            self._first_seen.clear()
            return 0
        started = self.state.started(self.device_ids)
        here = self.runs_here()
        now, seen, handed = self.clock(), self._first_seen, 0
        self._first_seen = {}
        for record in started:
            run = (record.job.id, record.placement.id)
            if run in here:
                continue
            since = seen.get(run, now)
            if now - since < self.min_age_s or run not in seen:
                self._first_seen[run] = since
                continue
            log.warning(
                "job %s is recorded as running on %s, which does not run it (Redis lost its "
                "end, or came back from an older state)",
                record.job.id,
                record.placement.device_id,
            )
            self._end_again(record)
            handed += 1
        return handed

"""A decode loop's text, made on a thread of its own: each sampled token's characters, the
stop strings, the job's ``on_text`` (the chunk publisher, a job's first chunk written to
Redis), and each job's end.

The decode thread hands over one list a step (:meth:`TextRelay.put`): the time the step
decoded, ``(job, token, piece)`` for every token it sampled, in order, then ``(job, reason,
now, flush)`` for every job whose sequence it retired. While llama.cpp computes the next
step (a GPU's ``llama_decode`` lets go of the GIL for the whole step), this thread turns
the last one into text, so the Python behind each token's text is off the path between two
decodes.

A job's end is the last item of it the relay reads: its held-back text is published, its
account made and ``done`` set here, so its caller never sees ``done`` before its text. A
stop string found here, or an ``on_text`` that raised, halts the job (:attr:`Job.halted`):
its text stops at once, the decode loop retires it at its next step (up to LAG + 1 more
tokens may have been decoded meanwhile: they are not its answer, not counted in it, and
its time ends at the stop; an error the loop meets meanwhile does not fail an answer that
is whole).

The relay is at most :data:`LAG` steps behind: a decode loop that gets further ahead waits
(an ``on_text`` that blocks holds the loop, as it would if called there), so a job's text
and its stop strings trail its tokens by a bounded few, and so does memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from workers.engine.job import Job, StepTimes

log = logging.getLogger(__name__)

LAG = 4  # steps handed over and not yet taken up by the relay, at most
# in order: each step's time (an int), its tokens' (job, token, piece), ends' (job, reason,
# now, flush)
Items = list[Any]


class TextRelay:
    """The thread that turns one decode loop's tokens into its jobs' text (module doc)."""

    def __init__(self, name: str, times: StepTimes) -> None:
        self.name = name
        self.times = times  # adds relay_ns only: the decode thread adds the rest
        self._queue: queue.SimpleQueue[Items | None] = queue.SimpleQueue()
        self._room = threading.Semaphore(LAG)  # a step handed over takes one, made gives back
        self._now = 0  # when the tokens it reads were decoded (perf_counter_ns)
        self._thread = threading.Thread(target=self._run, name=f"text-{name}", daemon=True)
        self._thread.start()

    def put(self, items: Items) -> None:
        self._room.acquire()
        self._queue.put(items)

    def close(self) -> None:
        """Return once every item put before is done (every job's ``done`` set)."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (items := self._queue.get()) is not None:
            started = time.perf_counter_ns()
            try:
                for item in items:
                    self._take(item)
            finally:  # the decode loop never waits on a relay that lost its place
                self._room.release()
                self.times.relay_ns += time.perf_counter_ns() - started

    def _take(self, item: Any) -> None:
        if item.__class__ is int:
            self._now = item
            return
        try:
            if len(item) == 3:
                self._token(*item)
            else:
                self._end(*item)
        except BaseException:  # a bug here must not lose the thread, nor hang the job
            log.exception("the text of a job on %s failed", self.name)
            job = item[0]
            self._fail(job, "its text could not be made")
            if len(item) == 4:
                job.done.set()

    def _token(self, job: Job, token: int, piece: bytes) -> None:
        if job.halted:
            return
        job.out.append(token)
        text, stopped = job.stops.feed(job.utf8.feed(piece))
        try:
            job.emit(text)
        except Exception as exc:
            self._fail(job, f"the consumer of its text failed ({exc!r})")
            return
        if stopped:  # its answer is whole: it ends here, whatever comes after
            job.halted, job.stop_at, job.stop_ns = True, len(job.out), self._now

    def _end(self, job: Job, reason: str, now: int, flush: bool) -> None:
        if job.stop_at:  # an error the loop met after its stop string takes nothing from it
            job.error, reason, now, job.generated = None, "stop", job.stop_ns, job.stop_at
            del job.sampler.logprobs[job.stop_at - job.forced :]  # one a sampled token
        elif job.error is None and flush:
            try:
                job.emit(job.tail())
            except Exception as exc:
                self._fail(job, f"the consumer of its text failed ({exc!r})")
        if job.error is None:
            job.stats = job.finished(reason, now)
        job.done.set()

    def _fail(self, job: Job, why: str) -> None:
        if job.error is None:
            job.error = job.failure(self.name, why)
        job.halted = True

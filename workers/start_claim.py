"""Whether one delivery of a job runs it (:class:`StartClaim`), and the two ways a delivered
job turns out not to be this worker's to run or to end (:class:`NotOwned`, :class:`HandBack`)."""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from scheduler.errors import JobFailed
from scheduler.protocol import JobRequest, Placement
from scheduler.settings import Settings
from scheduler.store.cancel import CancelWatcher
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.worker_state import WorkerState
from workers.backlog import patiently
from workers.generation import AnyRunner, Progress
from workers.handback import NotOwned
from workers.keepalive import effective_keep_alive
from workers.publisher import ChunkPublisher
from workers.strays import Strays

log = logging.getLogger(__name__)
STREAM_AWAY_S = 120.0  # a run waits this long for its stream's Redis to claim it
STREAM_AWAY = -3  # what _claim_stream gives when that Redis did not answer


class Runs(Protocol):
    """What a start claim reads and marks in the worker that runs the job."""

    settings: Settings
    state: WorkerState
    clock: Callable[[], float]
    cancels: CancelWatcher
    _jobs_lock: threading.Lock
    _running: dict[tuple[str, str], Placement]
    strays: Strays

    def _runs(self) -> set[tuple[str, str]]: ...

    def _schedule_expiry(self, runner_id: str, at: float | None) -> None: ...


class StartClaim:
    """Whether one delivery of a job runs it: the job's start claim (lua/start.lua), made
    once, before the job's runner is loaded or, on a resident runner, while its first step
    runs. Text a held publisher was given waits for the claim: it is published once the
    job is this delivery's, and never when it is not (its run is cancelled, it ends nothing
    here: another delivery, or placement, owns it)."""

    def __init__(
        self,
        runtime: Runs,
        req: JobRequest,
        placement: Placement,
        publisher: ChunkPublisher,
    ) -> None:
        self.runtime, self.req, self.placement, self.publisher = runtime, req, placement, publisher
        # a job delivered as Redis goes away waits for it to come back (if its device was
        # dropped meanwhile, it is not this device's any more)
        self.delivery = uuid.uuid4().hex
        self.owned = False
        self.unseen = False  # what it published before it was claimed is never published
        self.settled = False

    def make(self) -> None:
        """Claim the job's run for this delivery (once); raises NotOwned if it is not."""
        if self.owned:
            return
        rt, req, placement = self.runtime, self.req, self.placement
        if (req.id, placement.id) in rt._runs():
            # another delivery of a run under way here (Redis came back from before its
            # start claim, and its message with it): the run goes on, once
            log.warning("job %s runs here already: not running it again", req.id)
            self.publisher.discard()
            raise NotOwned(req.id)
        # Redis refusing the script (out of memory, read-only) raises: asked again, by
        # ours(), before the job's error is published
        cancelled_now = patiently(
            lambda: rt.state.start(
                placement.device_id,
                req.id,
                placement.id,
                self.delivery,
                rt.clock(),
            ),
            f"starting job {req.id}",
            math.inf,  # giving up here would leak the job's slot
        )
        if cancelled_now is None:
            # the device was dropped meanwhile (this worker was stopped or lost its Redis
            # connection) and placement re-placed or failed the job
            # (or this is a second delivery: it runs once, elsewhere in this pool)
            log.warning("job %s is no longer this device's: not running it here", req.id)
            self.publisher.discard()
            raise NotOwned(req.id)
        # its one run ended here: claimed again by its message come again, it ends as it
        # did (not an embedding: its vectors travel in its result, which only a run stores)
        if req.kind != "embed" and rt.strays.end_again(placement, req.id):
            self.publisher.discard()
            raise NotOwned(req.id)
        run = (req.id, placement.id)
        with rt._jobs_lock:  # running here, for the strays look, while its stream is claimed
            rt._running[run] = placement
        last = None
        try:
            last = self._claim_stream()
        finally:
            if last is None:  # not running here: one Redis has running, the strays look hands back
                with rt._jobs_lock:
                    rt._running.pop(run, None)
        if last is None:  # taken from this run between its start and its stream's claim
            log.warning("job %s was taken from this run as it began: not running it", req.id)
            self.publisher.discard()
            raise NotOwned(req.id)
        self.owned = True
        rt.cancels.watch(req.id, cancelled_now)
        self._judge_stream(last)

    def _claim_stream(self) -> int | None:
        """Where streams live on Redis instances of their own, the run names itself the
        holder of its job's stream there (the custody record cannot fence it from afar):
        the seq of the stream's last chunk (-1: the stream ended; :data:`STREAM_AWAY`: no
        answer), None when the job is another's now."""
        rt, req, placement = self.runtime, self.req, self.placement
        try:
            return patiently(
                lambda: rt.state.claim_stream(req.id, placement.id),
                f"claiming job {req.id}'s stream",
                STREAM_AWAY_S,
            )
        except REDIS_AWAY:
            return STREAM_AWAY

    def _judge_stream(self, last: int) -> None:
        """A run from the start that finds chunks in its stream (a run the job was taken
        from wrote them), or a stream that ended, or one whose Redis did not answer: the
        job ends with an error, after what is there. Never a second answer into one stream."""
        req = self.req
        # a resumed run that read its stream before this claim (on a resident runner) goes
        # on from what it read: the stream must hold that still, no more
        if last == 0 or (last > 0 and req.resumed and self.publisher.seq in (0, last)):
            return
        read, self.publisher.seq = self.publisher.seq, max(self.publisher.seq, last)
        self.unseen = True  # what this run published so far goes nowhere
        if last == STREAM_AWAY:
            raise JobFailed(
                f"job {req.id} could not claim its stream for {STREAM_AWAY_S:.0f} s: its "
                "stream's Redis (GGUFQ_STREAM_REDIS_URLS) or the cluster's did not answer; "
                "submit it again once they do"
            )
        if last < 0:
            raise JobFailed(f"job {req.id}'s stream has ended already: it is not run again")
        if req.resumed:
            raise JobFailed(
                f"job {req.id}'s stream changed as it went on elsewhere ({last} chunks, "
                f"{read} read): it cannot go on from there; submit it again"
            )
        raise JobFailed(
            f"job {req.id}'s stream holds {last} chunks of an earlier run of it, written "
            "after placement took the job from that run's worker: it is not run again from "
            "the start into the same stream; submit it again"
        )

    def gate(self, progress: Progress) -> Progress:
        """``progress``, told only once the job is this delivery's (Flower shows another
        delivery's task as the job's)."""

        def gated(state: str, **fields: Any) -> None:
            if self.owned:
                progress(state, **fields)

        return gated

    def settle(self, runner: AnyRunner) -> None:
        """The job is this delivery's and out of the queue: its keep_alive applies to its
        runner, whose expiry waits for its end (once)."""
        if self.settled:
            return
        self.settled = True
        runner.keep_alive_s = effective_keep_alive(self.req.keep_alive_s, runner.keep_alive_s)
        self.runtime._schedule_expiry(self.placement.runner_id, None)

    def ours(self, resident: AnyRunner | None = None) -> bool:
        """Whether the job is this delivery's, claimed now if it was not yet (it failed
        before its first step on its ``resident`` runner): then what it published so far
        goes out (called once its run ended: nothing is published for it meanwhile)."""
        try:
            self.make()
        except NotOwned:
            return False
        except JobFailed:  # its stream was another run's: it ends with its own error after
            pass
        self.publisher.release(publish_held=not self.unseen)
        if resident is not None and not self.unseen:
            self.settle(resident)
        return True

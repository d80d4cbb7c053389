"""How a worker gives back a job it was delivered but will not run: the job is no longer
this device's (:class:`NotOwned`: dropped without a result), or nothing of it ran and
placement places it again (:class:`HandBack`, :class:`RunnerGone`: lua/end.lua writes its
orphan record in the same step as its in-flight record goes), or its run was stopped
before its end (:func:`stopped_run`)."""

from __future__ import annotations

import logging
import sys

from scheduler.errors import JobFailed
from scheduler.protocol import JobRequest, Placement, SentJob

log = logging.getLogger(__name__)


class NotOwned(Exception):
    """A delivered job that is no longer this device's: drop it without a result."""


class HandBack(NotOwned):
    """This device could not load the job's model: placement places the job again."""

    avoid_here = True  # placement places it on another device


class RunnerGone(HandBack):
    """The job's runner was gone from Redis before the job reached it (unloaded, its load
    failed, or its message was sent again after the runner went), or its decode loop
    stopped on a bug before the job's first token: placement places the job again, once,
    on any device."""

    avoid_here = False


def runner_stopped(req: JobRequest, device: str, why: str) -> RunnerGone | JobFailed:
    """How a job ends that met a runner whose decode loop stopped on a bug (``why``) with
    nothing of it run: placed again once, else failed saying what happened."""
    gone = (
        f"job {req.id}'s runner stopped and can serve no more jobs ({req.model!r} on "
        f"{device}): {why}"
    )
    return RunnerGone(gone) if req.attempt == 0 else JobFailed(gone + "; submit the job again")


def stopped_run(req: JobRequest, placement: Placement, worker: str) -> SentJob | None:
    """The orphan record that hands back a job whose run left before its end, stopped by
    what is raised as this is called (a SystemExit in task code, an error raised while an
    error was being handled): its end takes its in-flight record, and nothing else would
    place it again (re-placed once if nothing streamed, else it goes on elsewhere or fails
    saying so). None for NotOwned (the job is another's now): its run just stops."""
    stopped = sys.exc_info()[1]
    if stopped is None or isinstance(stopped, NotOwned):
        return None
    log.error("job %s: its run was stopped (%r): handing it back", req.id, stopped)
    why = f"its run on {placement.device_id} was stopped before its end ({stopped!r})"
    return SentJob(job=req, placement=placement, worker=worker, lost=why)

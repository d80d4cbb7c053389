"""Jobs placement sent that never reached an end: those of dropped devices (orphans), and
those whose message to a live device vanished with a broken connection. Each is re-placed
once, sent again, or ended with an error that says what happened; never dropped."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

import redis
from celery import Celery
from pydantic import ValidationError

from scheduler.errors import GgufqError, JobFailed
from scheduler.midstream import Resumed, why_not_resumed
from scheduler.placement.parking import HeldJobs
from scheduler.protocol import JobRequest, SentJob
from scheduler.store.cancel import cancelled_before_start, is_cancelled
from scheduler.store.celery_app import run_message
from scheduler.store.due import Deadlines, DueSend
from scheduler.store.hands import Held, Swept
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import error_chunk, pay_owed, progress

log = logging.getLogger("ggufq.placement")
# a send found waiting in its device's queue is looked at again after it has waited as
# long again, at most this long: a message lost as a worker takes it is sent again within
# that (plus a look's window) however long it had waited
MAX_LOOK_AGAIN_S = 30.0

Fail = Callable[[str, str, GgufqError], None]


def lost_job_message(
    job_id: str, where: str, streamed: int, why: str = "", why_not_on: str = ""
) -> str:
    what = (
        f"after it had streamed {streamed} chunks (its partial output stays in the job's "
        f"stream), and it could not go on elsewhere: {why_not_on}"
        if streamed
        else "after it had already been re-run once"
    )
    why = why or f"worker {where} stopped heartbeating while it held the job"
    return f"job {job_id} was lost: {why}, {what}; submit it again"


class Recovery:
    def __init__(
        self,
        client: redis.Redis,
        app: Celery,
        state: PlacementState,
        held: HeldJobs,
        fail: Fail,
        replace: Callable[[JobRequest], object],
        hold_ttl_s: float,
        stream_ttl_s: int,
        resume_max: int = 2,
    ) -> None:
        self.r, self.app, self.state, self.held = client, app, state, held
        # a placement process may hold a job that long (GGUFQ_DEVICE_TTL_S) before its
        # hold is swept: a runner's job counted longer ago with no record is never coming
        self.hold_ttl_s = hold_ttl_s
        self.fail, self.replace = fail, replace
        self.stream_ttl_s = stream_ttl_s  # what a job leaves in Redis lives as long as its stream
        self.resume_max = resume_max  # times a job that streamed may go on elsewhere
        self.due = Deadlines(client)
        # sends due that the last look found nowhere: sent again if the next look does not
        # find them either (a process that starts again looks twice)
        self._unseen: set[DueSend] = set()
        # runner id -> the placements it counted that no record named, at the last look
        self._unaccounted: dict[str, set[str]] = {}

    def orphans(self) -> int:
        """Handle the jobs that were sent to devices since dropped (their worker died or
        stopped): re-place a job once when nothing of it had been streamed, otherwise end it
        with an error that says what happened. Returns how many were handled."""
        handled = 0
        for job_id in self.state.orphans():
            with self.held.takes():  # one Redis did not answer: asked again once it is back
                raw = self.state.claim_orphan(job_id)
            if raw is None:
                continue  # another placement process handles it
            handled += 1
            try:
                self._orphaned(job_id, raw)
            except Exception as exc:  # Redis went away: handled again once it is back
                log.warning("job %s waits for Redis to be re-placed or ended: %s", job_id, exc)
                self.held.hold_orphan(job_id, raw)
        return handled

    def _orphaned(self, job_id: str, raw: bytes) -> None:
        """Re-place one orphaned job (its record ``raw``): once when it had streamed
        nothing, to go on from its last token when it had (scheduler/midstream.py), or end
        it with an error."""
        try:
            record = SentJob.model_validate_json(raw)
        except ValidationError as exc:
            unreadable = JobFailed(f"job {job_id} was lost: its record cannot be read ({exc})")
            self.fail(job_id, "", unreadable)
            return
        req = record.job
        found = self.state.fenced_progress(job_id)
        if found is None:  # swept from this process as it stalled: another's now
            self.state.hands.hand_over(job_id)
            return
        streamed, finished = found
        if finished:
            self.state.hands.let_go(job_id)
            return  # it ended before its device was dropped
        where = f"{record.worker} ({record.placement.device_id})"
        why_not = self._why_not_on(req) if streamed else ""
        if is_cancelled(self.r, job_id):
            self.fail(job_id, req.model, cancelled_before_start(job_id))
        elif streamed == 0 and req.attempt == 0:
            log.warning("re-placing job %s from %s", job_id, where)
            avoid = req.avoid + record.avoid
            self.replace(req.model_copy(update={"attempt": 1, "avoid": avoid}))
        elif streamed and not why_not:
            log.warning(
                "job %s goes on from chunk %d: its run on %s stopped", job_id, streamed, where
            )
            note = Resumed(
                worker=record.worker,
                device=record.placement.device_id,
                chunks=streamed,
                at=time.time(),
            )
            update = {"resumed": [*req.resumed, note], "avoid": req.avoid + record.avoid}
            self.replace(req.model_copy(update=update))
        else:
            lost = lost_job_message(job_id, where, streamed, record.lost, why_not)
            self.fail(job_id, req.model, JobFailed(lost))

    def _why_not_on(self, req: JobRequest) -> str:
        """Why a job that streamed cannot go on elsewhere ("" when it can)."""
        logprobs = req.options.top_logprobs is not None
        return why_not_resumed(req.kind, logprobs, len(req.resumed), self.resume_max)

    def dead_hands(self, now: float, ttl_s: float) -> int:
        """Put back the jobs that placement processes silent for ``ttl_s`` (killed, or
        stalled) had in hand: a submission or a parked job in the parked queue, an orphan
        among the orphans, each once; a job that was sent or ended meanwhile is let go; one
        its holder was ending is ended. Sweeps this process's own entries held that long
        that it no longer decides on (a Redis restored from an older snapshot). Returns how
        many were put back."""
        hands, dead_before, back = self.state.hands, now - ttl_s, 0
        others, own = hands.look(dead_before)
        for held in others + own:
            try:  # where streams live apart, one whose Redis is away waits for the next look
                _streamed, finished = progress(self.state.streams.of(held.job_id), held.job_id)
            except redis.RedisError as exc:
                if not self.state.streams.sharded:
                    raise
                log.warning("job %s: its stream's Redis is away (%s)", held.job_id, exc)
                continue
            lost = {why: _lost_in_hand(held, why) for why in (Swept.ENDING, Swept.UNREADABLE)}
            ends = (_final(held, lost[Swept.ENDING]), _final(held, lost[Swept.UNREADABLE]))
            outcome = hands.sweep(held, dead_before, finished, ends, self.stream_ttl_s)
            if outcome is Swept.PUT_BACK:
                what = "among the orphans" if held.what == "orphan" else "in the parked queue"
                why = (
                    "this process, which no longer decides on it (Redis restored from an "
                    "older snapshot?)"
                    if held.holder == hands.name
                    else f"{held.holder}, which stopped beating"
                )
                log.warning("job %s was in the hands of %s: put back %s", held.job_id, why, what)
                back += 1
            elif outcome in (Swept.UNREADABLE, Swept.ENDING):  # ended in the sweep's step
                log.warning("%s", lost[outcome])
                try:
                    self.app.backend.mark_as_failure(held.job_id, lost[outcome])
                except Exception as exc:  # its stream's final chunk ends it for readers
                    log.warning("job %s's failed result was not written: %s", held.job_id, exc)
        return back

    def owed_finals(self, ended_before: float) -> int:
        """Where streams live on Redis instances of their own: the final chunks whose
        writer stopped between a job's end and its chunk (killed there), written here
        (:func:`scheduler.store.streams.pay_owed`)."""
        if not self.state.streams.sharded:
            return 0
        return pay_owed(self.r, self.state.streams, ended_before, self.stream_ttl_s)

    def lost_sends(self, sent_before: float) -> int:
        """Send again the jobs sent to a live device before ``sent_before`` (Redis's clock)
        that no worker started and whose message is not in the device's queues: a worker
        pops a message with no record of it (its consumer keeps none of unacknowledged
        ones), so a connection that breaks as it arrives (a Redis restart) loses it, and
        the job's slot with it. A job is sent again only when two looks in a row find it
        nowhere, as a new placement of it (:meth:`_send_again`): the first message, should
        it turn up, and a run of it a crash forgot are refused, so it runs once. Reads
        only the sends due (``ggufq:due:sent``): one found waiting in its queue is looked at
        again after it has waited as long again (at most MAX_LOOK_AGAIN_S). Then corrects
        the runners' counts (:meth:`recount`). Returns how many were sent again."""
        again, unseen = 0, set()
        seen_before, self._unseen = self._unseen, set()  # a failed look counts none
        now = self.due.now()
        dues = self.due.sends(sent_before)
        if not dues:
            self.recount(now)
            return 0
        # three round trips for the whole look: the records, their starts, the queues
        records = self.due.records(dues)
        current = [r for d in dues if (r := records.get(d)) is not None]
        # ended, reaped or placed again (another placement id): not due any more
        settled = [d for d in dues if d not in records]
        later: dict[DueSend, float] = {}
        waiting = self.state.unstarted(current, float("inf"))
        still = {DueSend.of(r) for r in waiting}
        for record in current:
            if DueSend.of(record) not in still:  # started: forgotten, or moved on if it
                settled.append(DueSend.of(record))  # started only by its chunks (settle.lua)
                later[DueSend.of(record)] = _again_at(record, now)
        present = self.state.in_broker([DueSend.of(r) for r in waiting])
        for record in waiting:
            due = DueSend.of(record)
            if due in present:
                later[due] = _again_at(record, now)
                continue
            if due not in seen_before:
                unseen.add(due)  # due again at the next look
                continue
            if self._send_again(record, now):
                again += 1
        self.due.settled(settled)
        self.due.look_again(later)  # after: only what settling kept moves on
        self._unseen = unseen
        self.recount(now)
        return again

    def _send_again(self, record: SentJob, now: float) -> bool:
        """Send a job whose message was lost again, as a new placement of it (its epoch
        raised, lua/resend.lua): its first message, should it turn up, and a run of it a
        Redis crash forgot are fenced off, so it runs once into its stream. False when it
        started, ended or was placed again since the look read it."""
        req = record.job
        placement = record.placement.model_copy(update={"id": uuid.uuid4().hex[:12]})
        moved = record.model_copy(update={"placement": placement, "sent_at": now})
        queue, message = run_message(self.app, req, placement)
        if not self.state.resend(record, moved, queue, message):
            return False
        log.warning(
            "job %s's message to %s was lost (a broken broker connection); sending it again "
            "as placement %s (was %s)",
            req.id,
            placement.device_id,
            placement.id,
            record.placement.id,
        )
        return True

    def recount(self, now: float) -> None:
        """Forget jobs a runner counts that its in-flight records do not account for, when two
        looks in a row find the same ones and they were counted longer ago than a job is
        held: a job counted whose record was never written (a reply lost mid-commit) would
        keep the runner full for good (placement parks a full runner's jobs) and never idle.
        Only the runners with such a count due (``ggufq:due:counted``) are read; ``now`` is
        Redis's time."""
        unaccounted: dict[str, set[str]] = {}
        for runner_id, due in self.due.counts(now - self.hold_ttl_s).items():
            seen = self._unaccounted.get(runner_id, set())
            pruned = self.state.prune(runner_id, seen, time.time(), self.hold_ttl_s)
            left = pruned.unaccounted - pruned.forgotten
            if left:
                unaccounted[runner_id] = left
            self.due.counts_settled(runner_id, due - left)  # recorded meanwhile, or gone
            if pruned.forgotten:
                what = "runner %s counted jobs %s that no in-flight record names: forgotten%s"
                gone = "; it was loading for them only, and is released" if pruned.released else ""
                log.warning(what, runner_id, ", ".join(sorted(pruned.forgotten)), gone)
                self.state.announce_recount(runner_id)
        self._unaccounted = unaccounted


def _again_at(record: SentJob, now: float) -> float:
    """When a send found waiting (or started only by its chunks) is looked at again: once
    it has waited as long again, at most MAX_LOOK_AGAIN_S from ``now``."""
    return now + min(max(now - record.sent_at, 0.0), MAX_LOOK_AGAIN_S)


def _lost_in_hand(held: Held, outcome: Swept) -> JobFailed:
    why = (
        "as it was ending it"
        if outcome is Swept.ENDING
        else "as it handled it, and its record there cannot be read"
    )
    return JobFailed(
        f"job {held.job_id} was lost: placement process {held.holder} stopped {why}; "
        "submit it again"
    )


def _final(held: Held, exc: JobFailed) -> str:
    return json.dumps(error_chunk("", held.job_id, exc))

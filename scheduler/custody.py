"""A job's life, as data: its named states, who moves it from each state to which (and by
which Lua script), and what happens when whoever holds it stops answering.

This module is the map a reader opens first to answer "what happens to a job when ...":
README's "When things fail" prints :data:`TRANSITIONS` and :data:`LAPSES` as tables, every
Lua script that moves a job names its transitions in its header (``-- Moves a job:``), and
``tests/test_custody.py`` holds the three to each other. Each job's custody record
(``ggufq:job:<id>:custody``: state, holder, epoch, when) is moved by those scripts in the same
step as the job's other keys, and checked against :data:`TRANSITIONS`: each script is given
its own rows as a Lua table (scheduler/store/scripts.py), and a move from the recorded state
that they do not allow is refused before anything is written (a job ended stays so;
placement does not end a job a worker runs). ``ggufq fsck`` reads where each job is in
Redis (:func:`state_of`) and reports a job found in two states at once, or in another state
than its record names.

Pure: no Redis, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class JobState(StrEnum):
    """Where a job is: its custody record's state. The job's other keys in Redis, which
    fsck holds the record to, are named in each member's comment."""

    SUBMITTED = "submitted"  # job:<id>:submitted; its message on a placement queue
    PLACING = "placing"  # in_hand under a placement process (a claim or a take)
    PARKED = "parked"  # ggufq:parked + parked:<id>: waiting for capacity
    SENT = "sent"  # inflight:<device>, held by its placement id; its message on the queue
    RUNNING = "running"  # also ggufq:running and its start claim: a worker runs it
    ORPHANED = "orphaned"  # ggufq:orphans: its device was dropped, or its load handed back
    DONE = "done"  # the stream's final chunk (and the result) with no error
    FAILED = "failed"  # the stream's final chunk carries the error
    CANCELLED = "cancelled"  # the final chunk says cancel


ENDED = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


class Actor(StrEnum):
    CLIENT = "client"
    PLACEMENT = "placement"
    WORKER = "worker"
    SWEEP = "sweep"  # any placement process, acting for one that stopped answering


@dataclass(frozen=True)
class Transition:
    source: JobState
    target: JobState
    actor: Actor
    script: str  # the Lua script (lua/<name>.lua) that makes it, "" for a plain write
    when: str

    @property
    def name(self) -> str:
        return f"{self.source.value} -> {self.target.value}"


S = JobState
TRANSITIONS: tuple[Transition, ...] = (
    Transition(S.SUBMITTED, S.PLACING, Actor.PLACEMENT, "place", "it takes the message"),
    Transition(S.SUBMITTED, S.SENT, Actor.CLIENT, "fast_send", "a resident runner has a slot"),
    Transition(S.SUBMITTED, S.FAILED, Actor.PLACEMENT, "final", "its message cannot be read"),
    Transition(S.PLACING, S.SENT, Actor.PLACEMENT, "sent", "decided: recorded, sent, let go"),
    Transition(S.PLACING, S.PARKED, Actor.PLACEMENT, "put_back", "no room now"),
    Transition(S.PLACING, S.ORPHANED, Actor.PLACEMENT, "put_back", "an orphan it cannot place now"),
    Transition(S.PLACING, S.PARKED, Actor.SWEEP, "sweep", "its holder went silent"),
    Transition(S.PLACING, S.ORPHANED, Actor.SWEEP, "sweep", "its holder went silent"),
    Transition(
        S.PLACING,
        S.FAILED,
        Actor.SWEEP,
        "sweep",
        "its holder went silent as it ended it, or its entry cannot be read",
    ),
    Transition(S.PLACING, S.FAILED, Actor.PLACEMENT, "final", "refused, or lost twice"),
    Transition(S.PLACING, S.CANCELLED, Actor.PLACEMENT, "final", "asked to cancel"),
    Transition(S.PARKED, S.PLACING, Actor.PLACEMENT, "take", "capacity may have freed"),
    Transition(S.PARKED, S.FAILED, Actor.PLACEMENT, "final", "it can never run"),
    Transition(S.PARKED, S.CANCELLED, Actor.PLACEMENT, "final", "asked to cancel as it waits"),
    Transition(S.SENT, S.SENT, Actor.PLACEMENT, "resend", "its message was lost: a new placement"),
    Transition(S.SENT, S.RUNNING, Actor.WORKER, "start", "its one delivery starts it"),
    Transition(S.SENT, S.ORPHANED, Actor.SWEEP, "reap", "its device went silent"),
    Transition(S.RUNNING, S.ORPHANED, Actor.SWEEP, "reap", "its device went silent"),
    Transition(
        S.RUNNING,
        S.ORPHANED,
        Actor.WORKER,
        "end",
        "its model could not load there, its runner was gone before it arrived or its "
        "decode loop had stopped, or no run holds it there (Redis lost its end)",
    ),
    Transition(
        S.SENT, S.ORPHANED, Actor.WORKER, "end", "handed back, as running -> orphaned, unstarted"
    ),
    Transition(S.SENT, S.DONE, Actor.WORKER, "end", "its final chunk; Redis lost its start"),
    Transition(S.SENT, S.FAILED, Actor.WORKER, "end", "its error chunk, as sent -> done"),
    Transition(S.SENT, S.CANCELLED, Actor.WORKER, "end", "cancelled mid-run, as sent -> done"),
    Transition(S.RUNNING, S.DONE, Actor.WORKER, "end", "its final chunk, slot freed"),
    Transition(S.RUNNING, S.FAILED, Actor.WORKER, "end", "its error chunk, slot freed"),
    Transition(S.RUNNING, S.CANCELLED, Actor.WORKER, "end", "cancelled mid-run"),
    Transition(S.ORPHANED, S.PLACING, Actor.PLACEMENT, "take", "to re-place or fail it"),
)


@dataclass(frozen=True)
class Lapse:
    """What happens to a job in ``state`` when whoever holds it stops answering."""

    state: JobState
    holder: str
    after: str
    outcome: str


LAPSES: tuple[Lapse, ...] = (
    Lapse(
        S.SUBMITTED,
        "the placement queue",
        "its reader finds it on no queue and unclaimed for 5 s",
        "its reader sends it again; placement places it once (its claim)",
    ),
    Lapse(
        S.PLACING,
        "a placement process",
        "the holder's beats stop for GGUFQ_DEVICE_TTL_S (Redis's clock), or the holder "
        "itself finds it held that long and no longer decides on it (Redis restored from "
        "an older snapshot)",
        "put back where it was taken from, once; a job already sent is let go, one being "
        "ended is failed in the same step; the holder, if it resumes, finds it swept and "
        "does nothing more",
    ),
    Lapse(
        S.PARKED,
        "nobody",
        "-",
        "waits for capacity; woken by events, or by the park sweep",
    ),
    Lapse(
        S.SENT,
        "its device's worker",
        "the device's beats stop for GGUFQ_DEVICE_TTL_S (Redis's clock)",
        "orphaned with the device; a message lost on a live device is sent again after "
        "two looks find it nowhere, as a new placement of the job (its epoch raised: the "
        "first message, should it turn up, and a run of it a crash forgot are fenced off); "
        "a look reads only the sends due (ggufq:due:sent), and one found queued is looked "
        "at again after as long again, at most 30 s",
    ),
    Lapse(
        S.RUNNING,
        "its device's worker",
        "the device's beats stop for GGUFQ_DEVICE_TTL_S (Redis's clock)",
        "orphaned; re-placed once if nothing was streamed, else placed again to go on from "
        "its last chunk (GGUFQ_RESUME_MAX times, scheduler/midstream.py), then failed with "
        "what happened; "
        "the old run's chunks and result are fenced off by the job's custody record (its "
        "holder is no longer the old run's placement id). A live worker that holds no run "
        "of it (Redis lost its end) writes that end again, or, if it did not end it, hands "
        "it back the same way; a job it ran to its end lately that comes to it again "
        "(Redis came back from before that end) gets that end written again, not a second "
        "run",
    ),
    Lapse(
        S.ORPHANED,
        "nobody",
        "-",
        "a placement process takes it at its next liveness look",
    ),
)


def transitions_of(script: str) -> set[str]:
    """The transitions ``lua/<script>.lua`` makes, by name ("sent -> running")."""
    return {t.name for t in TRANSITIONS if t.script == script}


def allowed(source: JobState, target: JobState) -> bool:
    return any(t.source is source and t.target is target for t in TRANSITIONS)


@dataclass(frozen=True)
class Evidence:
    """Where one job id was found in Redis (``ggufq fsck`` reads them all at once)."""

    parked: bool = False
    orphaned: bool = False
    held_by: tuple[str, ...] = ()  # placement processes that hold it in hand
    sent_to: tuple[str, ...] = ()  # devices whose in-flight records name it
    running: bool = False


def state_of(evidence: Evidence) -> tuple[JobState | None, list[str]]:
    """The state the evidence shows, and what is wrong with it: a job is in one state at a
    time."""
    places: list[tuple[JobState, str]] = []
    if evidence.parked:
        places.append((S.PARKED, "parked"))
    if evidence.orphaned:
        places.append((S.ORPHANED, "among the orphans"))
    for device in evidence.sent_to:
        places.append((S.SENT, f"in flight on {device}"))
    for holder in evidence.held_by:
        places.append((S.PLACING, f"in the hands of {holder}"))
    problems = []
    if len(evidence.sent_to) > 1:
        problems.append("sent to several devices: " + ", ".join(evidence.sent_to))
    if len(evidence.held_by) > 1:
        problems.append("held by several placement processes: " + ", ".join(evidence.held_by))
    if evidence.running and not evidence.sent_to:
        problems.append("running, with no in-flight record on any device")
    if len({state for state, _ in places}) > 1:
        problems.append("in two states at once: " + ", ".join(where for _, where in places))
    if not places:
        return None, problems
    state = places[0][0]
    if state is S.SENT and evidence.running:
        state = S.RUNNING
    return state, problems


def tables() -> str:
    """README's tables of :data:`TRANSITIONS` and :data:`LAPSES` (``python -m
    scheduler.custody`` prints them)."""
    lines = ["| from | to | by | script | when |", "|---|---|---|---|---|"]
    for t in TRANSITIONS:
        script = f"`{t.script}.lua`" if t.script else "-"
        lines.append(
            f"| {t.source.value} | {t.target.value} | {t.actor.value} | {script} | {t.when} |"
        )
    lines += ["", "| state | held by | lapses when | then |", "|---|---|---|---|"]
    for lapse in LAPSES:
        lines.append(f"| {lapse.state.value} | {lapse.holder} | {lapse.after} | {lapse.outcome} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(tables(), end="")

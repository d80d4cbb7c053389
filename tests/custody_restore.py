"""The custody state machine's jobs and processes as ``tests/test_custody_machine.py`` plays
them, and its fault "Redis is restored from an older snapshot" (:class:`RestoredFromSnapshot`,
a mixin of its rules): Redis comes back from its last save while every process keeps what it
holds in memory, and each meets the older Redis as the real one does."""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from hypothesis.stateful import precondition, rule

from scheduler.custody import JobState
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import keys
from scheduler.store.hands import Hands, Swept
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import Appended
from scheduler.store.worker_state import WorkerState
from tests.conftest import send
from tests.test_state import vgpu

DEVICE = vgpu(0, total_gib=64).id
TTL = 60
CONFIG = RunnerConfig(512)
FOREVER = 1e12
P = ("p1", "p2")
ENDS = ('{"done": true, "error": {}}', '{"done": true, "error": {}}')  # none ends here


@dataclass
class Job:
    request: JobRequest
    state: JobState
    holder: str = ""  # the placement process that holds it (PLACING)
    placement: Placement | None = None  # where it was sent (SENT, RUNNING)
    ended: int = 0  # times its end was written
    moves: int = 1  # its custody record's epoch: raised at every move (claimed: the first)


@dataclass
class Snapshot:
    """What Redis wrote to disk (each key, its expiry in ms, its DUMP), and the jobs,
    runners and lost commits as they stood then."""

    keys: list[tuple[bytes, int, bytes]]
    jobs: dict[str, Job]
    runners: dict[str, set[str]]
    lost: dict[str, set[str]]


class RestoredFromSnapshot:
    """The restore fault's rules, mixed into tests/test_custody_machine.py's machine, whose
    steps (``move``, ``_send``, ``_end``) and state they use."""

    r: redis.Redis
    jobs: dict[str, Job]
    runners: dict[str, set[str]]
    lost: dict[str, set[str]]
    snapshot: Snapshot | None
    ended_here: set[tuple[str, str]]
    hands: dict[str, Hands]
    state: dict[str, PlacementState]
    worker: WorkerState
    clock: dict[str, float]
    move: Any
    _send: Any
    _end: Any

    @rule()
    def redis_saves_a_snapshot(self) -> None:
        """Redis writes its data out (a SAVE, an AOF rewrite, a replica's copy): what a
        restore brings back later."""
        saved = []
        for key in self.r.scan_iter(count=1000):
            value = self.r.dump(key)
            if value is not None:
                saved.append((key, max(int(self.r.pttl(key)), 0), value))
        self.snapshot = Snapshot(
            saved, copy.deepcopy(self.jobs), copy.deepcopy(self.runners), copy.deepcopy(self.lost)
        )

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def redis_is_restored_from_an_older_snapshot(self) -> None:
        """Redis comes back from its last save: every write since is gone, while the
        processes keep what they hold in memory. Each then meets the older Redis as the
        real one does: a placement thread's hold that Redis no longer knows as it left it
        is refused its next write, and its process's look puts back what it no longer
        holds; the worker claims again a run whose start was lost, writes again an end it
        wrote (a stray marked running), hands back a stray it never ended, and a run of a
        job Redis places elsewhere is fenced off; a job Redis forgot whole is ended by the
        run that holds it, or its reader is told it is lost (JobLost)."""
        snapshot = self.snapshot
        assert snapshot is not None
        before = self.jobs
        runs = {  # the worker's runs, in its memory
            (j, job.placement.id)
            for j, job in before.items()
            if job.state is JobState.RUNNING and job.placement
        }
        self.r.flushdb()
        for key, ttl_ms, value in snapshot.keys:
            self.r.restore(key, ttl_ms, value, replace=True)
        self.jobs = copy.deepcopy(snapshot.jobs)
        self.runners, self.lost = copy.deepcopy(snapshot.runners), copy.deepcopy(snapshot.lost)
        for job_id, job in sorted(before.items()):
            if job.state is JobState.PLACING:
                self._holds_after_the_restore(job_id, job)
        for p in P:
            self._own_look(p)
        for job_id, _placement_id in sorted(runs):
            self._run_after_the_restore(job_id, before[job_id])
        for job_id, job in sorted(self.jobs.items()):
            if job.state is JobState.RUNNING and job.placement:
                if (job_id, job.placement.id) not in runs:
                    self._stray(job_id, job)

    def _holds_after_the_restore(self, job_id: str, held: Job) -> None:
        """A placement thread that held ``job_id`` when Redis was restored goes on with it."""
        hands = self.hands[held.holder]
        token = hands.token(job_id)
        entry = self.r.hget(keys.IN_HAND, hands.field(job_id))
        job = self.jobs.get(job_id)
        if job is None:  # Redis forgot it whole: the thread sends it, as Redis knows nothing
            self.jobs[job_id] = Job(held.request, JobState.PLACING, held.holder, moves=0)
            self._send(job_id)
            return
        if entry is not None and json.loads(entry)["token"] == token:
            assert (job.state, job.holder) == (JobState.PLACING, held.holder)
            return  # Redis has it in this hold still: the thread decides on it
        # another hold of it, or it is elsewhere: this thread's next write is refused
        runner_id = f"r-{uuid.uuid4().hex[:8]}"
        placement = Placement(id="stale", runner_id=runner_id, device_id=DEVICE, config=CONFIG)
        stale = SentJob(job=held.request, placement=placement, worker="w@h")
        assert not send(self.state[held.holder], stale), f"job {job_id} sent by a stale hold"
        assert not hands.token(job_id)  # refused, the thread lets go of it

    def _own_look(self, p: str) -> None:
        """``p``'s look finds jobs Redis says it holds that no thread of it holds (it let go
        of them after the save): it puts each back, once."""
        hands = self.hands[p]
        sec, micros = self.r.time()
        dead_before = float(sec) + micros / 1e6 + 1  # held a TTL ago, for the look
        _others, own = hands.look(dead_before)
        for held in own:
            if hands.token(held.job_id) == held.token:
                continue  # a thread still holds it in this hold
            assert hands.sweep(held, dead_before, False, ENDS, 600) is Swept.PUT_BACK
            job = self.jobs[held.job_id]
            self.move(job, JobState.ORPHANED if held.what == "orphan" else JobState.PARKED)
            job.holder = ""

    def _run_after_the_restore(self, job_id: str, ran: Job) -> None:
        """The worker's run of ``job_id`` (as ``ran`` had it placed) goes on."""
        assert ran.placement is not None
        placement, now = ran.placement, self.clock["w"]
        job = self.jobs.get(job_id)
        if job is None:  # Redis forgot the job whole: its run writes its end all the same
            self.jobs[job_id] = Job(ran.request, JobState.RUNNING, placement=placement, moves=0)
            self.runners.setdefault(placement.runner_id, {placement.id})
            self._end(job_id)
            if not self.r.exists(keys.runner(placement.runner_id)):
                del self.runners[placement.runner_id]
            return
        if job.placement is None or job.placement.id != placement.id:
            last = (1, {"response": "", "done": True})
            appended, _ = self.worker.end(placement, job_id, last, now, 0, 600)
            assert appended is Appended.FENCED, f"a stale run of job {job_id} ended it"
            return
        if job.state is JobState.SENT:  # its start was lost: its one run goes on to its end
            self._end(job_id)

    def _stray(self, job_id: str, job: Job) -> None:
        """Redis says the worker runs ``job_id``, which no run of it holds: its end is
        written again if the worker ended it, else it is handed back."""
        assert job.placement is not None
        if (job_id, job.placement.id) in self.ended_here:
            self._end(job_id)
            return
        placement, now = job.placement, self.clock["w"]
        orphan = SentJob(job=job.request, placement=placement, worker="w@h")
        self.worker.end(placement, job_id, (0, None), now, None, 600, orphan=orphan)
        self.runners[placement.runner_id].discard(placement.id)
        self.move(job, JobState.ORPHANED)
        job.placement = None

"""Custody as a state machine against a real Redis (hypothesis): two placement processes and
a worker move jobs through their states with the store's own scripts, while faults come
between any two steps: a placement process goes silent and another sweeps what it held
(then it resumes, stale), a reply is lost (the step runs again), a device's worker goes
silent and its device is reaped, a commit's reply is lost (its runner counts a job that
never comes), a process's own clock is a minute off Redis's, Redis is restored from an older
snapshot (the processes keep what they hold in memory). After every step ``ggufq fsck``'s
invariants hold, every job is where the custody table says it must be, and each runner's
job set is the jobs sent to it (and the lost commits not yet pruned); no job is ended twice
by two runs; at the end every job can end.

The same scripts serve the real stack; only the processes around them are played here."""

from __future__ import annotations

import json
import uuid

import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from scheduler.custody import JobState, allowed, state_of
from scheduler.protocol import JobRequest, Placement, SentJob
from scheduler.store import fsck, keys
from scheduler.store.due import Deadlines
from scheduler.store.hands import Hands, PutBack, Swept, parked_record
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import Appended
from scheduler.store.worker_state import WorkerState
from tests.conftest import beat_forever, send
from tests.custody_restore import (
    CONFIG,
    DEVICE,
    ENDS,
    FOREVER,
    TTL,
    Job,
    P,
    RestoredFromSnapshot,
    Snapshot,
)
from tests.test_state import GIB, vgpu


class Custody(RestoredFromSnapshot, RuleBasedStateMachine):
    r: redis.Redis  # the test's database, set before hypothesis makes machines

    def __init__(self) -> None:
        super().__init__()
        self.r.flushdb()
        self.worker = WorkerState(self.r)
        self.worker.register_device(vgpu(0, total_gib=64))
        beat_forever(self.r, DEVICE)
        self.hands = {p: Hands(self.r, p) for p in P}
        self.state = {p: PlacementState(self.r, self.hands[p]) for p in P}
        for p in P:
            self.r.zadd(keys.PLACEMENT_ALIVE, {p: FOREVER})
        self.jobs: dict[str, Job] = {}
        self.runners: dict[str, set[str]] = {}  # runner -> the placements it must count
        # each process's own clock (the placement processes', the worker's "w"): Redis's
        # time at the start, until a fault puts one a minute off
        sec, micros = self.r.time()
        self.clock = dict.fromkeys([*P, "w"], float(sec) + micros / 1e6)
        self.lost: dict[str, set[str]] = {}  # runner -> placements counted, never recorded
        self.snapshot: Snapshot | None = None  # Redis's last save
        # the runs the worker ended, (job, placement): its memory, which no restore takes
        self.ended_here: set[tuple[str, str]] = set()
        self.submitted = 0

    # -- helpers --------------------------------------------------------------------
    def in_state(self, *states: JobState) -> list[str]:
        return sorted(j for j, job in self.jobs.items() if job.state in states)

    def move(self, job: Job, target: JobState) -> None:
        assert allowed(job.state, target), f"{job.state} -> {target} is not a transition"
        job.state = target
        job.moves += 1

    # -- the steps, each as its process takes it ------------------------------------
    def _park(self, job_id: str, again: bool = False) -> None:
        job = self.jobs[job_id]
        hands = self.hands[job.holder]
        record = parked_record(job.request.model_dump(mode="json"), self.clock[job.holder])
        token = hands.token(job_id)
        assert hands.put_back("parked", job_id, record) is PutBack.PUT_BACK
        if again:  # its reply was lost: asked again under the same token
            hands.adopt(job_id, token)
            hands.put_back("parked", job_id, record)
        self.move(job, JobState.PARKED)
        job.holder = ""

    def _take(self, job_id: str, p: str, again: bool = False) -> None:
        job = self.jobs[job_id]
        what = "orphan" if job.state is JobState.ORPHANED else "parked"
        hands = self.hands[p]
        raw = hands.take(what, job_id)
        assert raw is not None
        if again:  # the same taker asks again after a lost reply: the same record
            token = hands.hand_over(job_id)
            assert hands.take(what, job_id, token) == raw
        self.move(job, JobState.PLACING)
        job.holder = p

    def _send(self, job_id: str, again: bool = False) -> None:
        """Record the job as sent and let go of it, in one step."""
        job = self.jobs[job_id]
        runner_id = f"r-{uuid.uuid4().hex[:8]}"
        state = self.state[job.holder]
        placement_id = uuid.uuid4().hex[:12]
        now = self.clock[job.holder]
        assert state.reserve(runner_id, placement_id, {DEVICE: GIB}, {"model": "m"}, now, TTL)
        placement = Placement(id=placement_id, runner_id=runner_id, device_id=DEVICE, config=CONFIG)
        self.runners[runner_id] = {placement_id}
        record = SentJob(job=job.request, placement=placement, worker="w@h")
        assert send(state, record)
        if again:
            assert send(state, record)  # the same record written twice is there once
        self.hands[job.holder].hand_over(job_id)  # off this thread's path
        job.holder = ""
        self.move(job, JobState.SENT)
        job.placement = placement

    def _start(self, job_id: str, again: bool = False) -> None:
        job = self.jobs[job_id]
        assert job.placement is not None
        pid = job.placement.id
        now = self.clock["w"]
        assert self.worker.start(DEVICE, job_id, pid, "delivery", now) is False
        if again:  # a second delivery of its message does not run it again
            assert self.worker.start(DEVICE, job_id, pid, "another", now) is None
        self.worker.update_runner(job.placement.runner_id, {"state": "ready"})  # it loaded
        self.move(job, JobState.RUNNING)
        if any(ended == job_id for ended, _placement in self.ended_here):
            # its one run ended on this worker in writes Redis lost (an older snapshot): the
            # worker writes that end again, under this placement, instead of a second run
            self._end(job_id, again=False, written_again=True)

    def _end(self, job_id: str, again: bool = False, written_again: bool = False) -> None:
        job = self.jobs[job_id]
        assert job.placement is not None
        last = (1, {"response": "", "done": True})
        for _ in range(2 if again else 1):  # written again after a lost reply: counted once
            appended, _left = self.worker.end(job.placement, job_id, last, self.clock["w"], 0, 600)
            assert appended is not Appended.FENCED
        self.runners[job.placement.runner_id].discard(job.placement.id)
        job.ended += 1
        if not written_again:
            self.ended_here.add((job_id, job.placement.id))
        self.move(job, JobState.DONE)

    # -- the rules: a step on a job drawn from those it applies to ------------------------
    @rule(p=st.sampled_from(P))
    def submit_and_claim(self, p: str) -> None:
        # ids in submission order: hypothesis replays a run, and draws by sorted ids
        request = JobRequest(id=f"job-{self.submitted:03d}", model="m", prompt="p")
        self.submitted += 1
        record = parked_record(request.model_dump(mode="json"), self.clock[p])
        assert self.state[p].place_once(request.id, uuid.uuid4().hex, 600, record).first
        self.jobs[request.id] = Job(request, JobState.PLACING, holder=p)

    @precondition(lambda self: self.in_state(JobState.PLACING))
    @rule(data=st.data(), again=st.booleans())
    def park(self, data: st.DataObject, again: bool) -> None:
        self._park(data.draw(st.sampled_from(self.in_state(JobState.PLACING))), again)

    @precondition(lambda self: self.in_state(JobState.PARKED, JobState.ORPHANED))
    @rule(data=st.data(), p=st.sampled_from(P), again=st.booleans())
    def take(self, data: st.DataObject, p: str, again: bool) -> None:
        waiting = self.in_state(JobState.PARKED, JobState.ORPHANED)
        self._take(data.draw(st.sampled_from(waiting)), p, again)

    @precondition(lambda self: self.in_state(JobState.PLACING))
    @rule(data=st.data(), again=st.booleans())
    def send(self, data: st.DataObject, again: bool) -> None:
        self._send(data.draw(st.sampled_from(self.in_state(JobState.PLACING))), again)

    @precondition(lambda self: self.in_state(JobState.SENT))
    @rule(data=st.data(), again=st.booleans())
    def start(self, data: st.DataObject, again: bool) -> None:
        self._start(data.draw(st.sampled_from(self.in_state(JobState.SENT))), again)

    @precondition(lambda self: self.in_state(JobState.SENT))
    @rule(data=st.data(), again=st.booleans())
    def its_message_is_lost_and_sent_again(self, data: st.DataObject, again: bool) -> None:
        """Two liveness looks found its message nowhere: it is sent again as a new placement
        of the job, and the first delivery, should it turn up, cannot start it."""
        job = self.jobs[data.draw(st.sampled_from(self.in_state(JobState.SENT)))]
        first = job.placement
        assert first is not None
        record = SentJob(job=job.request, placement=first, worker="w@h")
        placement = first.model_copy(update={"id": uuid.uuid4().hex[:12]})
        moved = SentJob(job=job.request, placement=placement, worker="w@h")
        queue, message = keys.device_queue(DEVICE), json.dumps({"task_id": job.request.id})
        assert self.state[P[0]].resend(record, moved, queue, message)
        if again:  # its reply was lost: asked again, it finds the job moved already
            assert not self.state[P[0]].resend(record, moved, queue, message)
        self.runners[first.runner_id] = self.runners[first.runner_id] - {first.id} | {placement.id}
        job.placement = placement
        self.move(job, JobState.SENT)
        now = self.clock["w"]
        assert self.worker.start(DEVICE, job.request.id, first.id, "first", now) is None

    @precondition(lambda self: self.in_state(JobState.RUNNING))
    @rule(data=st.data(), again=st.booleans())
    def end(self, data: st.DataObject, again: bool) -> None:
        self._end(data.draw(st.sampled_from(self.in_state(JobState.RUNNING))), again)

    # -- faults -----------------------------------------------------------------------
    @precondition(lambda self: self.in_state(JobState.PLACING))
    @rule(silent=st.sampled_from(P))
    def a_placement_process_goes_silent(self, silent: str) -> None:
        """Its beats stop past the TTL: the other sweeps what it held back to where it
        came from (what it sent it let go of in the same step); then it resumes (its beats
        come back), stale."""
        survivor = self.hands[P[1 - P.index(silent)]]
        self.r.zadd(keys.PLACEMENT_ALIVE, {silent: 0.0})
        sec, micros = self.r.time()
        dead_before = float(sec) + micros / 1e6 + 1  # a TTL after it took them
        others, _own = survivor.look(dead_before)
        for held in others:
            job = self.jobs[held.job_id]
            assert job.holder == silent
            assert survivor.sweep(held, dead_before, False, ENDS, 600) is Swept.PUT_BACK
            back = JobState.ORPHANED if held.what == "orphan" else JobState.PARKED
            self.move(job, back)
            job.holder = ""
            # the stale holder resumes and tries to send it: refused, it is not its own
            runner_id = f"r-{uuid.uuid4().hex[:8]}"
            placement = Placement(id="stale", runner_id=runner_id, device_id=DEVICE, config=CONFIG)
            stale = SentJob(job=job.request, placement=placement, worker="w@h")
            assert not send(self.state[silent], stale)
        self.r.zadd(keys.PLACEMENT_ALIVE, {silent: FOREVER})

    @precondition(lambda self: self.in_state(JobState.SENT, JobState.RUNNING))
    @rule()
    def the_device_goes_silent(self) -> None:
        """Its worker stops beating: reaped with its runners; its jobs become orphans;
        then the worker comes back and registers again."""
        self.r.hset(keys.device(DEVICE), "heartbeat", 0.0)
        self.r.zadd(keys.HEARTBEATS, {DEVICE: 0.0})
        assert self.state[P[0]].reap(TTL) == [DEVICE]
        for job_id in self.in_state(JobState.SENT, JobState.RUNNING):
            job = self.jobs[job_id]
            self.move(job, JobState.ORPHANED)
            job.placement = None
        self.worker.register_device(vgpu(0, total_gib=64))
        beat_forever(self.r, DEVICE)
        self.runners.clear()
        self.lost.clear()

    @precondition(lambda self: self.runners)
    @rule(data=st.data())
    def a_commits_reply_is_lost(self, data: st.DataObject) -> None:
        """Placement assigned a job to a runner and lost the answer: it decides again
        elsewhere, and the runner counts a placement whose record never comes."""
        runner_id = data.draw(st.sampled_from(sorted(self.runners)))
        lost = f"lost-{uuid.uuid4().hex[:6]}"
        assert self.state[P[0]].assign(runner_id, lost, self.clock[P[0]])
        self.runners[runner_id].add(lost)
        self.lost.setdefault(runner_id, set()).add(lost)

    @rule(who=st.sampled_from([*P, "w"]), off_s=st.sampled_from([-60.0, 0.0, 60.0]))
    def a_clock_is_a_minute_off(self, who: str, off_s: float) -> None:
        """A process's own clock jumps (NTP, a VM resumed) a minute either way of Redis's,
        or back: liveness and custody run on Redis's clock, so nothing a process stamps
        with its own may decide where a job is or whether it ends."""
        sec, micros = self.r.time()
        self.clock[who] = float(sec) + micros / 1e6 + off_s

    @precondition(lambda self: self.lost)
    @rule()
    def two_liveness_looks_prune_what_no_record_names(self) -> None:
        self._prune()

    def _prune(self) -> None:
        due = Deadlines(self.r).counts(FOREVER)  # every count due, even one made just now
        for runner_id, lost in self.lost.items():  # the recount's look finds each lost one
            assert lost <= due.get(runner_id, set())
        for runner_id in sorted(self.runners):
            now = self.clock[P[1]]
            seen = self.state[P[1]].prune(runner_id, set(), now, 0).unaccounted
            pruned = self.state[P[1]].prune(runner_id, seen, now, 0)
            assert pruned.forgotten == self.lost.pop(runner_id, set())
            self.runners[runner_id] -= pruned.forgotten
            if pruned.released:  # still loading, its own job gone: nobody would load it
                assert self.r.hget(keys.runner(runner_id), "state") is None
                del self.runners[runner_id]

    # -- what must hold after every step ---------------------------------------------
    @invariant()
    def fsck_finds_nothing(self) -> None:
        assert [str(p) for p in fsck.problems(fsck.read(self.r))] == []

    @invariant()
    def each_runner_counts_the_jobs_sent_to_it(self) -> None:
        counted = {
            runner_id: {p.decode() for p in self.r.hkeys(keys.runner_jobs(runner_id))}
            for runner_id in (r.decode() for r in self.r.smembers(keys.RUNNERS))
        }
        assert counted == self.runners

    @invariant()
    def every_job_is_where_custody_says(self) -> None:
        census = fsck.read(self.r)
        for job_id, job in self.jobs.items():
            evidence = census.evidence(job_id)
            found, wrong = state_of(evidence)
            assert wrong == []
            expected = None if job.state is JobState.DONE else job.state
            assert found is expected, f"job {job_id}: {found}, expected {job.state}"
            assert evidence.held_by == ((job.holder,) if job.holder else ())
            assert job.ended <= 1

    @invariant()
    def each_job_record_says_its_state_holder_and_epoch(self) -> None:
        for job_id, job in self.jobs.items():
            raw = self.r.hgetall(keys.job_custody(job_id))
            record = {k.decode(): v.decode() for k, v in raw.items()}
            holder = job.holder
            if job.state in (JobState.SENT, JobState.RUNNING, JobState.DONE):
                holder = job.placement.id if job.placement else ""
            assert (record["state"], record["holder"], int(record["epoch"])) == (
                job.state.value,
                holder,
                job.moves,
            ), f"job {job_id}"

    @invariant()
    def no_job_ends_by_two_runs(self) -> None:
        ended: dict[str, set[str]] = {}
        for job_id, placement_id in self.ended_here:
            ended.setdefault(job_id, set()).add(placement_id)
        assert all(len(placements) == 1 for placements in ended.values()), ended

    def teardown(self) -> None:
        """Every job can still end: each is taken on to its end, and then nothing is
        left anywhere and no runner counts a job."""
        steps = {
            JobState.PARKED: lambda j: self._take(j, P[0]),
            JobState.ORPHANED: lambda j: self._take(j, P[0]),
            JobState.PLACING: self._send,
            JobState.SENT: self._start,
            JobState.RUNNING: self._end,
        }
        self._prune()
        for _ in range(len(steps)):
            for job_id, job in sorted(self.jobs.items()):
                if job.state in steps:
                    steps[job.state](job_id)
        assert all(job.state is JobState.DONE for job in self.jobs.values())
        self.no_job_ends_by_two_runs()
        assert [str(p) for p in fsck.problems(fsck.read(self.r), settled=True)] == []


def test_custody_holds_under_faults_between_any_two_steps(db: redis.Redis) -> None:
    Custody.r = db
    run_state_machine_as_test(
        Custody,
        settings=settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            # no explain phase: it traces every line of a failing run again, which against
            # Redis outlasts the test's timeout and hides the failure behind it
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )

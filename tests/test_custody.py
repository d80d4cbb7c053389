"""A job's life as data (scheduler/custody.py), the Lua scripts that move it, README's tables,
and ``ggufq fsck``'s invariants against a real Redis."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from api_client.client import Client
from scheduler.custody import TRANSITIONS, Evidence, JobState, state_of, tables, transitions_of
from scheduler.local.stack import LocalStack
from scheduler.placement.parking import ParkedJobs
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import fsck, keys
from scheduler.store.hands import Hands, Swept, parked_record
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import Appended, publish_final
from scheduler.store.worker_state import WorkerState
from tests.conftest import fall_silent, ggufq, send, stack_env
from tests.test_state import GIB, vgpu

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "scheduler" / "store" / "lua"
MOVES = re.compile(r"^-- Moves a job \(scheduler/custody\.py\): (.*)$", re.M)


def test_each_script_names_the_transitions_it_makes() -> None:
    named = {}
    for path in sorted(LUA.glob("*.lua")):
        found = MOVES.findall(path.read_text())
        named[path.stem] = set(", ".join(found).split(", ")) if found else set()
    for script in {t.script for t in TRANSITIONS if t.script}:
        assert script in named, f"lua/{script}.lua is in the custody table but not on disk"
    for script, moves in named.items():
        assert moves == transitions_of(script), f"lua/{script}.lua's header"


def test_readme_prints_the_custody_tables() -> None:
    assert tables() in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("evidence", "state", "wrong"),
    [
        (Evidence(parked=True), JobState.PARKED, ""),
        (Evidence(sent_to=("d1",)), JobState.SENT, ""),
        (Evidence(sent_to=("d1",), running=True), JobState.RUNNING, ""),
        (Evidence(sent_to=("d1",), held_by=("p1",)), JobState.SENT, "two states"),
        (Evidence(held_by=("p1",)), JobState.PLACING, ""),
        (Evidence(parked=True, sent_to=("d1",)), JobState.PARKED, "two states"),
        (Evidence(orphaned=True, held_by=("p1",)), JobState.ORPHANED, "two states"),
        (Evidence(sent_to=("d1", "d2")), JobState.SENT, "several devices"),
        (Evidence(held_by=("p1", "p2")), JobState.PLACING, "several placement"),
        (Evidence(running=True), None, "no in-flight record"),
    ],
)
def test_a_job_is_in_one_state(evidence: Evidence, state: JobState | None, wrong: str) -> None:
    found, problems = state_of(evidence)
    assert found is state
    assert (wrong in " ".join(problems)) if wrong else problems == []


def sent_job(db: redis.Redis, runner_id: str, placement_id: str = "p1") -> JobRequest:
    job = JobRequest(model="m", prompt="p")
    placed = Placement(
        id=placement_id, runner_id=runner_id, device_id="vgpu:h:0", config=RunnerConfig(512)
    )
    assert send(PlacementState(db), SentJob(job=job, placement=placed, worker="w@h"))
    return job


def test_fsck_finds_what_breaks_an_invariant(db: redis.Redis) -> None:
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db)
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 1.0, 10)  # one job counted
    job = sent_job(db, "r")
    assert fsck.problems(fsck.read(db)) == []
    assert [str(p) for p in fsck.problems(fsck.read(db), settled=True)] == [
        f"job {job.id}: still in flight once settled",
        f"job {job.id}: recorded sent once settled",
        "runner r (m): counts 1 jobs in flight once settled",
    ]

    db.zadd(keys.PARKED, {job.id: 1.0})  # parked as well as sent: run twice, in time
    db.hdel(keys.runner_jobs("r"), "p1")  # a job it does not count: unloaded mid-job
    db.hset(keys.reservations("vgpu:h:0"), "gone", GIB)  # memory held for nobody
    db.hset(keys.job_custody(job.id), "holder", "p9")  # re-placed, its old record left behind
    found = [str(p) for p in fsck.problems(fsck.read(db))]
    assert found == [
        f"job {job.id}: in flight on vgpu:h:0 as placement p1, but its custody record names p9",
        f"job {job.id}: in two states at once: parked, in flight on vgpu:h:0",
        f"job {job.id}: parked without its record",
        f"job {job.id}: missing from its model's index of parked jobs",
        f"job {job.id}: recorded sent, found parked",
        "device vgpu:h:0: reserves 1073741824 bytes for runner gone, which is gone",
        "runner r (m): does not count placements p1, which in-flight records give it (it "
        "would unload mid-job)",
        "runner r (m): counts 1 jobs in flight, but its job set holds 0",
    ]


def test_ggufq_fsck_on_the_live_stack(stack: LocalStack, models_dir: Path, tmp_path: Path) -> None:
    env = {**stack_env(models_dir, tmp_path / "state"), "GGUFQ_REDIS_URL": stack.redis_url}
    out = ggufq("fsck", "--json", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout) == {"problems": [], "ok": True}
    human = ggufq("fsck", env=env)
    assert human.returncode == 0 and human.stdout.rstrip().endswith("no problems")


def test_where_a_job_is_says_its_custody(
    client: Client, stack: LocalStack, models_dir: Path, tmp_path: Path
) -> None:
    """A job's record follows it: placed (or sent by the fast path), run, done; its epoch
    counts the moves, and ``ggufq where`` prints it."""
    job = client.submit("tiny", "Where am I?", options={"num_predict": 2, "temperature": 0})
    job.result()
    record = client.custody(job.id)
    assert record is not None and (record.state, record.id) == ("done", job.id)
    # placing -> sent -> running -> done, or sent -> running -> done by the fast path
    assert record.epoch in (3, 4) and record.holder  # the placement it ran under
    assert client.custody("no-such-job") is None
    env = {**stack_env(models_dir, tmp_path / "state"), "GGUFQ_REDIS_URL": stack.redis_url}
    out = ggufq("where", job.id, "no-such-job", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["JOB", "STATE", "HOLDER", "EPOCH", "MOVED"]
    assert lines[1].split()[:4] == [job.id, "done", record.holder, str(record.epoch)]
    assert lines[2].startswith("no-such-job") and "unknown" in lines[2]


def test_parked_jobs_are_indexed_by_model(db: redis.Redis) -> None:
    """A job's end wakes the parked jobs of its runner's model only: they are read from
    that model's index, kept with the parked queue by the same scripts."""
    state = PlacementState(db)
    parked = ParkedJobs(db, state.hands)
    jobs = [JobRequest(model=m, prompt="p") for m in ("a", "b", "a", "c")]
    for order, job in enumerate(jobs):
        assert state.place_once(job.id, "delivery", 60, "{}").first  # placement takes it
        parked.park(job, float(order))
    assert parked.models() == {"a", "b", "c"}
    assert parked.ids({"a"}) == [jobs[0].id, jobs[2].id]
    assert [i for i, _job in parked.entries(models={"a", "c"})] == [
        jobs[0].id,
        jobs[2].id,
        jobs[3].id,
    ]
    assert parked.claim(jobs[0].id) is not None  # taken for a retry: out of the index too
    failed = {"error": {"code": "job_failed", "message": "it can never run"}}
    publish_final(db, jobs[3].id, failed, 60)  # ended while it waited
    assert parked.models() == {"a", "b"} and parked.ids({"a"}) == [jobs[2].id]
    assert db.hget(keys.job_custody(jobs[3].id), "state") == b"failed"
    assert [str(p) for p in fsck.problems(fsck.read(db))] == []
    parked.park(jobs[0], 0.0)  # back in the queue
    assert parked.ids({"a"}) == [jobs[0].id, jobs[2].id]


def everything(db: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key of the database and its value, but the count of refused moves."""
    return {k: db.dump(k) for k in sorted(db.keys()) if k != keys.CUSTODY_REFUSED.encode()}


def recorded_as(db: redis.Redis, job_id: str, state: str) -> None:
    """The job's custody record says ``state``, as a Redis restored from elsewhere might."""
    db.hset(keys.job_custody(job_id), "state", state)


def test_a_move_the_custody_table_does_not_allow_writes_nothing(db: redis.Redis) -> None:
    """Each script checks its move against the table before its first write: refused, it
    writes nothing, answers as when the job is not the caller's, and fsck reports it."""
    WorkerState(db).register_device(vgpu(0))
    job = sent_job(db, "r")
    recorded_as(db, job.id, "parked")  # waits for capacity, by its record: not to start
    before = everything(db)
    assert WorkerState(db).start("vgpu:h:0", job.id, "p1", "delivery", 100.0) is None
    assert everything(db) == before  # not running, its run not claimed
    recorded_as(db, job.id, "running")  # runs, by its record: not placement's to end
    before = everything(db)
    failed = {"error": {"code": "job_failed", "message": "it can never run"}}
    assert publish_final(db, job.id, failed, 60) is Appended.FENCED
    assert everything(db) == before  # no final chunk, nothing moved
    again = JobRequest(model="m", prompt="p")
    db.hset(keys.job_custody(again.id), mapping={"state": "sent", "holder": "p7", "epoch": 2})
    before = everything(db)
    assert not PlacementState(db).place_once(again.id, "late delivery", 60, "{}").first
    assert everything(db) == before  # not taken in hand, its claim not written
    assert [str(p) for p in fsck.problems(fsck.read(db)) if "custody" in str(p)] == [
        "custody: refused 1 moves parked -> running, which its table denies",
        "custody: refused 1 moves running -> failed, which its table denies",
        "custody: refused 1 moves sent -> placing, which its table denies",
    ]


def test_a_job_ended_is_neither_ended_again_nor_orphaned(db: redis.Redis) -> None:
    """A run's end is final: a second final chunk (another outcome) is fenced, and a
    reaped device's in-flight record that outlived the job's end orphans nothing."""
    WorkerState(db).register_device(vgpu(0))
    job = sent_job(db, "r")
    placed = Placement(id="p1", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    worker = WorkerState(db)
    assert worker.start("vgpu:h:0", job.id, "p1", "delivery", 100.0) is False
    done = (1, {"response": "", "done": True})
    assert worker.end(placed, job.id, done, 101.0, 300, 60)[0] is Appended.WRITTEN
    failed = (2, {"error": {"code": "job_failed", "message": "late"}, "done": True})
    assert worker.end(placed, job.id, failed, 102.0, 300, 60)[0] is Appended.FENCED
    assert db.xlen(keys.job_chunks(job.id)) == 1
    # Redis lost the end's removal of the in-flight record (a restore): the record says done
    sent = SentJob(job=job, placement=placed, worker="w@h")
    db.hset(keys.inflight("vgpu:h:0"), job.id, sent.model_dump_json())
    fall_silent(db, "vgpu:h:0", 3600)
    assert PlacementState(db).reap(60) == ["vgpu:h:0"]
    assert db.hlen(keys.ORPHANS) == 0
    assert db.hget(keys.job_custody(job.id), "state") == b"done"
    assert fsck.read(db).refused == {"done -> failed": 1, "done -> orphaned": 1}


def test_leftovers_of_a_job_its_record_places_elsewhere_move_nothing(db: redis.Redis) -> None:
    """An orphan entry of a job that ended (left by a version before the table was
    enforced) leaves the queue untaken, so it can never run again once its record expires;
    an in-flight record on a silent device that another placement of the job now holds
    orphans nothing and keeps that run's running mark."""
    WorkerState(db).register_device(vgpu(0))
    job = sent_job(db, "r")
    record = db.hget(keys.inflight("vgpu:h:0"), job.id) or b""
    db.hset(keys.ORPHANS, job.id, record)
    recorded_as(db, job.id, "done")
    hands = PlacementState(db).hands
    assert hands.take("orphan", job.id) is None
    assert db.hlen(keys.ORPHANS) == 0 and db.hlen(keys.IN_HAND) == 0
    recorded_as(db, job.id, "running")
    db.hset(keys.job_custody(job.id), "holder", "p2")  # placed again, running elsewhere
    db.hset(keys.RUNNING, job.id, 100.0)
    fall_silent(db, "vgpu:h:0", 3600)
    assert PlacementState(db).reap(60) == ["vgpu:h:0"]
    assert db.hlen(keys.ORPHANS) == 0 and db.hexists(keys.RUNNING, job.id)
    assert db.hmget(keys.job_custody(job.id), "state", "holder") == [b"running", b"p2"]
    assert fsck.read(db).refused == {"done -> placing": 1}


def test_a_hold_swept_from_a_job_recorded_elsewhere_leaves_it_there(db: redis.Redis) -> None:
    """A silent holder's hold of a job whose record says it runs (a leftover) is let go of,
    the job not parked again; the holder, come back, finds it swept, not sent by it."""
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db, Hands(db, "p-silent"))
    job = JobRequest(model="m", prompt="p")
    assert state.place_once(job.id, "delivery", 60, parked_record(job.model_dump(), 1.0)).first
    db.hset(keys.job_custody(job.id), mapping={"state": "running", "holder": "p1"})
    db.zadd(keys.PLACEMENT_ALIVE, {"p-silent": 0.0})
    survivor = Hands(db, "p-alive")
    sec, micros = db.time()
    dead_before = float(sec) + micros / 1e6 + 1
    (held,), _own = survivor.look(dead_before)
    failed = '{"done": true, "error": {}}'
    assert survivor.sweep(held, dead_before, False, (failed, failed), 60) is Swept.LET_GO
    assert db.zcard(keys.PARKED) == 0 and db.hlen(keys.IN_HAND) == 0
    assert db.hmget(keys.job_custody(job.id), "state", "swept") == [b"running", b"1"]
    placed = Placement(id="p9", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    assert not send(state, SentJob(job=job, placement=placed, worker="w@h"))  # swept: not its
    assert fsck.read(db).refused == {"running -> parked": 1}


def test_an_end_asked_again_writes_no_second_final_chunk(db: redis.Redis) -> None:
    """Placement's end of a job that will not run, asked again (its reply was lost), finds
    the job ended so already: one final chunk."""
    job = JobRequest(model="m", prompt="p")
    assert PlacementState(db).place_once(job.id, "delivery", 60, "{}").first
    failed = {"error": {"code": "job_failed", "message": "it can never run"}}
    assert publish_final(db, job.id, failed, 60) is Appended.WRITTEN
    assert publish_final(db, job.id, failed, 60) is Appended.DUPLICATE
    assert db.xlen(keys.job_chunks(job.id)) == 1
    assert fsck.read(db).refused == {}

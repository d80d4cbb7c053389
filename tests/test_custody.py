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
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import publish_final
from scheduler.store.worker_state import WorkerState
from tests.conftest import ggufq, send, stack_env
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

"""The placement edge under faults, against a real Redis (database 1) and a real Celery app:
a broker error between reserving and sending, and a parked record that no longer parses.
A claimed job always ends sent, parked or failed, and leaves no reservation behind."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scheduler.cluster import DeviceInfo
from scheduler.local.embedded import EmbeddedRedis
from scheduler.midstream import Resumed
from scheduler.placement import service as service_module
from scheduler.placement.service import MAX_PLACEMENT_ERRORS, PlacementService
from scheduler.placement.wakes import Wake
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import fsck, keys
from scheduler.store import placement_state as placement_state_module
from scheduler.store.celery_app import task_message
from scheduler.store.clock import redis_now
from scheduler.store.hands import PutBack, parked_record
from scheduler.store.streams import Appended, write_chunk
from scheduler.store.worker_state import WorkerState
from tests.conftest import placement_on_db1

GIB = 1 << 30
# Celery's Redis result backend still calls redis-py's deprecated setex
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


@pytest.fixture()
def service(
    redis_server: EmbeddedRedis, db: redis.Redis, models_dir: Path, tmp_path: Path
) -> Iterator[PlacementService]:
    device = DeviceInfo("vgpu:fh:0", "fh", "w@fh", "v", "vgpu", 4 * GIB, 4 * GIB, True)
    with placement_on_db1(redis_server, db, models_dir, tmp_path / "state", device) as service:
        yield service


def final_error(db: redis.Redis, job_id: str) -> dict[str, str]:
    entries = db.xrange(keys.job_chunks(job_id))
    last = json.loads(entries[-1][1][b"c"])
    assert last["done"]
    return last["error"]  # type: ignore[no-any-return]


def orphan(db: redis.Redis, job: JobRequest) -> None:
    """``job`` as an orphan: sent to a device since dropped, nothing of it streamed."""
    config = RunnerConfig.for_generation(256, 1, False)
    placement = Placement(id="p1", runner_id="r1", device_id="vgpu:fh:0", config=config)
    record = SentJob(job=job, placement=placement, worker="w@gone")
    db.hset(keys.ORPHANS, job.id, record.model_dump_json())


def test_a_send_that_fails_after_reserving_parks_the_job_and_releases_what_it_held(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broker_down(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Error 111 connecting to broker: Connection refused")

    monkeypatch.setattr(service.hands, "_sent", broker_down)
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    outcome = service.place(job.model_dump(mode="json"))
    assert "parked" in outcome
    assert [j.id for j in service.parked.jobs()] == [job.id]
    # the runner created for it, its reservation and its in-flight record are gone
    assert db.scard(keys.RUNNERS) == 0 and db.hlen(keys.reservations("vgpu:fh:0")) == 0
    assert db.hlen(keys.inflight("vgpu:fh:0")) == 0
    # each retry fails the same way; after MAX_PLACEMENT_ERRORS the job fails, saying why
    for _ in range(MAX_PLACEMENT_ERRORS):
        service.retry_parked()
    assert service.parked.jobs() == []
    error = final_error(db, job.id)
    assert error["code"] == "job_failed" and "Connection refused" in error["message"]
    assert db.scard(keys.RUNNERS) == 0 and db.hlen(keys.reservations("vgpu:fh:0")) == 0


def test_a_wake_sends_one_parked_job_per_slot_freed_and_claims_no_other(
    service: PlacementService, db: redis.Redis
) -> None:
    """A job's end frees one slot of its runner: the waker sends one parked job onto it
    and does not claim, decide and park the next one for nothing; a job that goes to
    another runner takes none of the freed slots."""
    options = {"num_parallel": 4}
    first = JobRequest(model="tiny", prompt="a", submitted_at=1.0, options=options)
    runner_id = service.place(first.model_dump(mode="json"))["runner"]
    jobs = [
        JobRequest(model="tiny", prompt=p, submitted_at=1.0, options=options)
        for p in ("b", "c", "d")
    ]
    for n, job in enumerate(jobs):
        service.parked.park(job, score=float(n))
    assert service.retry_parked(Wake(frozenset({"tiny"}), {"tiny": 1}, frozenset({runner_id}))) == 1
    assert service.parked.ids() == [jobs[1].id, jobs[2].id]  # in order, never taken out
    assert (
        service.retry_parked(Wake(frozenset({"tiny"}), {"other": 1}, frozenset({runner_id}))) == 0
    )
    # the slot freed was another runner's: these went elsewhere and took none of it
    assert service.retry_parked(Wake(frozenset({"tiny"}), {"tiny": 1}, frozenset({"another"}))) == 2


def test_a_parked_record_that_does_not_parse_fails_alone(
    service: PlacementService, db: redis.Redis
) -> None:
    db.set(keys.parked_job("garbled"), b"\xff not json")
    db.zadd(keys.PARKED, {"garbled": 0.5})
    good = JobRequest(model="tiny", prompt="hi", submitted_at=1.0)
    service.parked.park(good, score=1.0)
    assert service.retry_parked() == 2
    assert service.parked.ids() == []
    assert final_error(db, "garbled")["code"] == "invalid_request"
    assert db.hexists(keys.inflight("vgpu:fh:0"), good.id)  # the good one was sent


def test_a_parked_record_that_does_not_parse_ends_when_its_job_is_cancelled(
    service: PlacementService, db: redis.Redis
) -> None:
    db.set(keys.parked_job("garbled"), b"\xff not json")
    db.zadd(keys.PARKED, {"garbled": 0.5})
    assert service.cancel_parked("garbled")
    assert final_error(db, "garbled")["code"] == "invalid_request"
    assert service.parked.ids() == [] and db.hlen(keys.IN_HAND) == 0


def test_a_name_that_is_no_model_is_refused_and_not_counted_as_demand(
    service: PlacementService, db: redis.Redis
) -> None:
    for n in range(3):  # any number of made-up names: the demand table does not grow
        job = JobRequest(model=f"made-up-{n}", prompt="hi").model_dump(mode="json")
        assert service.place(job)["refused"] == "model_not_found"
    service.place(JobRequest(model="tiny", prompt="hi").model_dump(mode="json"))
    assert db.hkeys(keys.DEMAND) == [b"tiny"]


def test_a_message_that_is_not_a_job_is_refused_not_fatal(
    service: PlacementService, db: redis.Redis
) -> None:
    assert service.place(["not", "a", "job"])["refused"] == "invalid_request"  # type: ignore[arg-type]
    assert service.place({"id": "x1", "model": 7})["refused"] == "invalid_request"
    assert final_error(db, "x1")["code"] == "invalid_request"


def test_a_job_redis_drops_mid_placement_is_held_then_parked_when_it_is_back(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def redis_away(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1. Connection refused.")

    monkeypatch.setattr(service.hands, "_sent", redis_away)
    monkeypatch.setattr(service.hands, "_put_back", redis_away)  # parking it fails too
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    assert "held" in service.place(job.model_dump(mode="json"))
    with pytest.raises(redis.ConnectionError):
        service.park_held()  # still away: kept
    assert db.hlen(keys.IN_HAND) == 1  # still in this process's hands, in Redis too
    monkeypatch.undo()
    assert service.park_held() == 1
    assert [j.id for j in service.parked.jobs()] == [job.id]
    assert db.hlen(keys.IN_HAND) == 0  # parked: let go of, under the token it was held by
    assert service.park_held() == 0


def test_a_submission_delivered_twice_is_placed_once(service: PlacementService) -> None:
    job = JobRequest(model="no-such-model", prompt="hello", submitted_at=1.0)
    assert "refused" in service.place(job.model_dump(mode="json"))
    assert service.place(job.model_dump(mode="json")) == {"duplicate": job.id}


def test_a_submission_whose_claim_redis_missed_is_parked_once_it_is_claimed(
    service: PlacementService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def redis_away(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(service.state, "place_once", redis_away)
    held = JobRequest(model="tiny", prompt="held", submitted_at=1.0)
    taken = JobRequest(model="tiny", prompt="taken meanwhile", submitted_at=1.0)
    for job in (held, taken):
        assert "held" in service.place(job.model_dump(mode="json"))
    monkeypatch.undo()
    service.state.place_once(taken.id, "a later delivery of it", 60, "{}")
    assert service.park_held() == 1  # the other is placed by its later delivery
    assert [j.id for j in service.parked.jobs()] == [held.id]


def test_a_refusal_that_redis_takes_only_in_part_is_written_whole_once_it_is_back(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def result_lost(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Connection reset by peer")

    # the final error chunk goes through, then Redis goes away before the result is stored
    monkeypatch.setattr(service.app.backend, "mark_as_failure", result_lost)
    job = JobRequest(model="no-such-model", prompt="hello", submitted_at=1.0)
    assert service.place(job.model_dump(mode="json"))["refused"] == "model_not_found"
    assert final_error(db, job.id)["code"] == "model_not_found"
    monkeypatch.undo()
    assert service.app.AsyncResult(job.id).state == "PENDING"  # no result: a reader waits
    assert service.park_held() == 0  # nothing to park: the failure is written again, whole
    assert service.app.AsyncResult(job.id).state == "FAILURE"
    assert service.parked.jobs() == []  # never decided again (it was told it failed)


def test_an_orphan_whose_handling_redis_interrupts_is_handled_once_it_is_back(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRequest(model="no-such-model", prompt="hello", submitted_at=1.0)
    orphan(db, job)

    def redis_away(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(placement_state_module, "progress", redis_away)  # its stream's look
    assert service.recover_orphans() == 1
    assert not db.hexists(keys.ORPHANS, job.id)  # taken out, and kept in the process
    monkeypatch.undo()
    service.park_held()
    assert db.hexists(keys.ORPHANS, job.id)  # back among the orphans
    assert service.recover_orphans() == 1  # re-placed: its model is unknown, so it fails
    assert final_error(db, job.id)["code"] == "model_not_found"


def test_an_orphan_whose_run_redis_lost_fails_saying_so(
    service: PlacementService, db: redis.Redis
) -> None:
    """A worker gave back a job Redis held as running there without a run of it, after it
    had streamed, and had gone on elsewhere as often as it may: its error says what
    happened, not that the worker went silent."""
    went_on = Resumed(worker="w@fh", device="vgpu:fh:0", chunks=1, at=1.0)
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0, resumed=[went_on] * 2)
    config = RunnerConfig.for_generation(256, 1, False)
    placement = Placement(id="p1", runner_id="r1", device_id="vgpu:fh:0", config=config)
    why = "Redis holds it as running on vgpu:fh:0, whose worker has no run of it"
    record = SentJob(job=job, placement=placement, worker="w@fh", lost=why)
    db.hset(keys.ORPHANS, job.id, record.model_dump_json())
    write_chunk(db, job.id, 1, {"response": "partial"}, 60)  # streamed: not run again
    assert service.recover_orphans() == 1
    message = final_error(db, job.id)["message"]
    assert why in message and "stopped heartbeating" not in message
    assert "gone on elsewhere 2 times already (GGUFQ_RESUME_MAX=2)" in message


def test_an_orphan_that_streamed_goes_on_elsewhere_with_a_note(
    service: PlacementService, db: redis.Redis
) -> None:
    """A job whose worker died after it streamed is placed again, to go on from its last
    chunk: its request carries a note of the run that stopped."""
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    config = RunnerConfig.for_generation(256, 1, False)
    placement = Placement(id="p1", runner_id="r1", device_id="vgpu:fh:0", config=config)
    db.hset(
        keys.ORPHANS, job.id, SentJob(job=job, placement=placement, worker="w@fh").model_dump_json()
    )
    for seq in (1, 2):
        write_chunk(db, job.id, seq, {"response": "x", "tokens": [7]}, 60)
    assert service.recover_orphans() == 1
    (message,) = [
        m for m in db.lrange(keys.device_queue("vgpu:fh:0"), 0, -1) if job.id.encode() in m
    ]
    sent = json.loads(base64.b64decode(json.loads(message)["body"]))[0][0]
    (note,) = JobRequest.model_validate(sent).resumed
    assert (note.worker, note.device, note.chunks) == ("w@fh", "vgpu:fh:0", 2)
    assert db.xlen(keys.job_chunks(job.id)) == 2  # no final chunk: it goes on


def test_a_message_lost_on_its_way_to_a_live_device_is_sent_again_once(
    service: PlacementService, db: redis.Redis, models_dir: Path
) -> None:
    lost, queued, started = (  # four slots: all three go to the one runner
        JobRequest(model="tiny", prompt=p, submitted_at=1.0, options={"num_parallel": 4})
        for p in ("a", "b", "c")
    )
    for job in (lost, queued, started):
        assert "device" in service.place(job.model_dump(mode="json"))
    queue = keys.device_queue("vgpu:fh:0")
    messages = db.lrange(queue, 0, -1)
    assert len(messages) == 3
    # kombu popped lost's message and the connection broke before it was recorded
    db.lrem(queue, 1, next(m for m in messages if lost.id.encode() in m))
    # started's was taken and started by a worker thread
    db.lrem(queue, 1, next(m for m in messages if started.id.encode() in m))
    placement_id = json.loads(db.hget(keys.inflight("vgpu:fh:0"), started.id) or b"")
    claim = {"run": placement_id["placement"]["id"], "delivery": "delivery"}
    db.hset(keys.job_custody(started.id), mapping=claim)
    recovery, later = service.recovery, 1e12  # every record counts as sent long ago
    assert recovery.lost_sends(later) == 0  # first look: not yet
    assert recovery.lost_sends(later) == 1  # still nowhere: sent again
    again = db.lrange(queue, 0, -1)
    assert sum(lost.id.encode() in m for m in again) == 1
    assert not any(started.id.encode() in m for m in again)
    assert recovery.lost_sends(later) == 0  # it is queued again now
    # a job whose start claim Redis lost, still marked running, is not lost
    db.hdel(keys.job_custody(started.id), "run")
    db.hset(keys.RUNNING, started.id, 1.0)
    assert recovery.lost_sends(later) == 0
    assert recovery.lost_sends(later) == 0


def test_a_lost_send_is_sent_again_though_its_place_message_is_unacknowledged(
    service: PlacementService, db: redis.Redis
) -> None:
    """A Redis restart lost both placement's ack of a job's place message (kombu's unacked
    hash keeps it, naming the job, until its visibility timeout) and the reply that
    carried its run message to a worker: the look must not take the first for the
    second (it did, and resent the job after 95 s, at a chaos trial's bound)."""
    job = JobRequest(model="tiny", prompt="a", submitted_at=1.0)
    assert "device" in service.place(job.model_dump(mode="json"))
    queue = keys.placement_queue(job.priority)
    place = task_message(service.app, keys.TASK_PLACE, job, f"{job.id}.place", queue)
    db.hset(keys.UNACKED, "a delivery tag", json.dumps([json.loads(place), "", queue]))
    db.delete(keys.device_queue("vgpu:fh:0"))  # its run message, taken and lost
    assert service.recovery.lost_sends(1e12) == 0  # first look: not yet
    assert service.recovery.lost_sends(1e12) == 1  # nowhere on its device: sent again


def test_a_job_sent_again_is_a_new_placement_that_fences_the_first(
    service: PlacementService, db: redis.Redis
) -> None:
    """Redis lost the start claim of a run that goes on (a crash's last second), and the
    job's message is nowhere: sent again, it is a new placement of the job, so that the
    first delivery cannot start it again and the first run's chunks and end are refused:
    one run writes its stream."""
    job = JobRequest(model="tiny", prompt="a", submitted_at=1.0)
    runner_id = service.place(job.model_dump(mode="json"))["runner"]
    device, queue = "vgpu:fh:0", keys.device_queue("vgpu:fh:0")
    first = SentJob.model_validate_json(db.hget(keys.inflight(device), job.id) or b"")
    db.delete(queue)  # its worker took the message and started it; the crash lost the claim
    recovery = service.recovery
    assert recovery.lost_sends(1e12) == 0  # first look: not yet
    assert recovery.lost_sends(1e12) == 1
    again = SentJob.model_validate_json(db.hget(keys.inflight(device), job.id) or b"")
    assert again.placement.id != first.placement.id
    assert again.placement.model_copy(update={"id": first.placement.id}) == first.placement
    (message,) = db.lrange(queue, 0, -1)
    args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(message)["body"]))
    assert args[1]["id"] == again.placement.id  # the placement the worker gets with it
    assert db.hget(keys.job_custody(job.id), "holder") == again.placement.id.encode()
    assert db.hkeys(keys.runner_jobs(runner_id)) == [again.placement.id.encode()]
    assert db.hget(keys.runner(runner_id), "in_flight") == b"1"
    dues = [m.decode() for m in db.zrange(keys.DUE_SENT, 0, -1)]
    assert dues == [f"{job.id}|{again.placement.id}|{device}"]
    # the first run: its start (a redelivery of its message), chunks and end are refused
    state = WorkerState(db)
    assert state.start(device, job.id, first.placement.id, "first", time.time()) is None
    chunk = {"response": "stale"}
    assert write_chunk(db, job.id, 1, chunk, 60, first.placement.id) is Appended.FENCED
    assert not db.exists(keys.job_chunks(job.id))
    # the new one starts and writes
    assert state.start(device, job.id, again.placement.id, "again", time.time()) is False
    assert write_chunk(db, job.id, 1, chunk, 60, again.placement.id) is Appended.WRITTEN
    assert recovery.lost_sends(1e12) == 0  # started: not sent a third time
    # the first run's end, as it stops: refused, and the new run stays running and counted
    last = (2, {"response": "", "done": True})
    appended, left = state.end(first.placement, job.id, last, time.time(), None, 60)
    assert (appended, left) == (Appended.FENCED, 1)
    assert db.hexists(keys.RUNNING, job.id) and db.hexists(keys.inflight(device), job.id)


def test_the_lost_send_look_reads_only_what_came_due(
    service: PlacementService, db: redis.Redis
) -> None:
    """A job found waiting in its device's queue is looked at again only once it has
    waited as long again; an ended one is forgotten: a look costs the sends due, not the
    jobs in the cluster."""
    waiting, ended = (
        JobRequest(model="tiny", prompt=p, submitted_at=1.0, options={"num_parallel": 4})
        for p in ("a", "b")
    )
    for job in (waiting, ended):
        assert "device" in service.place(job.model_dump(mode="json"))
    db.hdel(keys.inflight("vgpu:fh:0"), ended.id)  # as its end does, but for the deadline
    db.zadd(keys.DUE_SENT, {"not a deadline": 1.0})  # malformed: dropped, the look goes on
    recovery, before = service.recovery, redis_now(db)
    assert len(recovery.due.sends(1e12)) == 2
    assert recovery.lost_sends(1e12) == 0
    (due,) = recovery.due.sends(1e12)  # the ended one is forgotten
    assert db.zscore(keys.DUE_SENT, "not a deadline") is None
    assert due.job_id == waiting.id
    # queued: moved on past the look, so a look up to then reads nothing
    assert (db.zscore(keys.DUE_SENT, due.member) or 0) >= before
    assert recovery.due.sends(before) == []


def test_a_count_no_record_accounts_for_is_corrected_after_two_looks(
    service: PlacementService, db: redis.Redis
) -> None:
    job = JobRequest(model="tiny", prompt="a", submitted_at=1.0)
    runner_id = service.place(job.model_dump(mode="json"))["runner"]
    # jobs counted whose records were never written (replies lost mid-commit)
    assert service.state.assign(runner_id, "lost-1", time.time())
    assert service.state.assign(runner_id, "lost-2", time.time())
    recovery = service.recovery
    recovery.hold_ttl_s = 0.0  # as if counted longer ago than a placement holds a job
    recovery.lost_sends(0.0)
    assert db.hget(keys.runner(runner_id), "in_flight") == b"3"  # one look: not yet
    recovery.lost_sends(0.0)
    assert db.hget(keys.runner(runner_id), "in_flight") == b"1"  # the one job recorded
    assert db.hkeys(keys.runner_jobs(runner_id)) == [service_placement(db, job.id)]
    service_placement_id = service_placement(db, job.id).decode()
    # loaded, then its record lost too (Redis restored from a snapshot taken between the
    # commit and the record: the count's deadline is there, the record not): idle, with
    # its expiry, as after an end (one still loading would be released: no worker has it)
    db.hset(keys.runner(runner_id), "state", "ready")
    db.hdel(keys.inflight("vgpu:fh:0"), job.id)
    db.zadd(keys.DUE_COUNTED, {f"{runner_id}|{service_placement_id}": 1.0})
    recovery.lost_sends(0.0)
    recovery.lost_sends(0.0)
    assert db.hget(keys.runner(runner_id), "in_flight") == b"0"
    assert float(db.hget(keys.runner(runner_id), "expires_at") or -1) > 0


class Killed(BaseException):
    """The placement process dies here: nothing after this line runs, nothing is caught."""


def killed(*_args: object, **_kwargs: object) -> None:
    raise Killed


def service_placement(db: redis.Redis, job_id: str) -> bytes:
    """The placement id of a job's in-flight record on the test's device."""
    record = json.loads(db.hget(keys.inflight("vgpu:fh:0"), job_id) or b"")
    return str(record["placement"]["id"]).encode()


def another(service: PlacementService, db: redis.Redis) -> PlacementService:
    """A second placement process beside ``service``, on the same Redis and device."""
    return PlacementService(service.settings, db, service.app)


def messages_for(db: redis.Redis, job_id: str) -> int:
    return sum(job_id.encode() in m for m in db.lrange(keys.device_queue("vgpu:fh:0"), 0, -1))


def test_a_submission_whose_placement_process_dies_mid_step_is_placed_by_another_once(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement acknowledges a submission as it starts it and claims its placement, so a
    process killed before it sends, parks or ends the job would leave it to no one (its
    reader sees it claimed and never sends it again): the job is held in hand instead, and
    another placement process puts it back once the holder has been silent for the TTL."""
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    monkeypatch.setattr(service, "_attempt", killed)
    with pytest.raises(Killed):
        service.place(job.model_dump(mode="json"))
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    assert survivor.recovery.dead_hands(time.time(), ttl) == 0  # taken just now: not yet
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 1
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # once
    assert [j.id for j in survivor.parked.jobs()] == [job.id]
    assert survivor.retry_parked() == 1
    assert messages_for(db, job.id) == 1 and db.hlen(keys.IN_HAND) == 0
    # a second delivery of the submission finds it placed
    assert survivor.place(job.model_dump(mode="json")) == {"duplicate": job.id}


def test_a_parked_job_taken_by_a_process_that_stalls_runs_once_and_leaks_no_slot(
    service: PlacementService, db: redis.Redis
) -> None:
    """The holder was only stalled (SIGSTOP, a long pause) past the TTL: what it does with
    the job once it resumes finds the job swept from it, and does nothing."""
    job = JobRequest(model="tiny", prompt="hi", submitted_at=1.0, options={"num_parallel": 4})
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    survivor.parked.park(job, score=1.0)
    claimed = service.parked.claim(job.id)  # taken out to retry; then the process stalls
    assert claimed is not None and survivor.parked.ids() == []
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 1
    assert survivor.retry_parked() == 1
    (runner_id,) = [r.decode() for r in db.smembers(keys.RUNNERS)]
    outcome = service._attempt(claimed.job, time.perf_counter_ns(), 1.0, 0)  # it resumes
    assert outcome == {"swept": job.id}
    assert messages_for(db, job.id) == 1 and survivor.parked.ids() == []
    # its commit counted the job on the runner: two looks correct the count to its record
    survivor.recovery.lost_sends(0.0)
    survivor.recovery.lost_sends(0.0)
    assert db.hget(keys.runner(runner_id), "in_flight") == b"1"
    assert db.hlen(keys.IN_HAND) == 0 and service.hands.token(job.id) == ""


def test_an_orphan_whose_placement_process_dies_as_it_handles_it_is_re_placed_once(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    orphan(db, job)
    monkeypatch.setattr(service.recovery, "_orphaned", killed)
    with pytest.raises(Killed):
        service.recover_orphans()
    assert db.hlen(keys.ORPHANS) == 0
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 1
    assert db.hexists(keys.ORPHANS, job.id)  # back among the orphans
    assert survivor.recover_orphans() == 1
    assert messages_for(db, job.id) == 1 and db.hlen(keys.IN_HAND) == 0


def test_a_job_its_dying_placement_process_had_ended_is_not_put_back(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRequest(model="no-such-model", prompt="hello", submitted_at=1.0)
    monkeypatch.setattr(service.hands, "let_go", killed)  # dies as it lets go of it
    with pytest.raises(Killed):
        service.place(job.model_dump(mode="json"))
    assert final_error(db, job.id)["code"] == "model_not_found"
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0
    assert survivor.parked.ids() == [] and db.hlen(keys.IN_HAND) == 0


def test_a_job_its_dying_placement_process_had_sent_is_not_put_back(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRequest(model="tiny", prompt="hello", submitted_at=1.0)
    monkeypatch.setattr(service.state, "count_request", killed)  # dies right after sending it
    with pytest.raises(Killed):
        service.place(job.model_dump(mode="json"))
    # its send let go of it in the same step: nothing of it is left in hand to sweep
    assert messages_for(db, job.id) == 1 and db.hlen(keys.IN_HAND) == 0
    assert db.hget(keys.job_custody(job.id), "state") == b"sent"
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # let go of only
    assert survivor.parked.ids() == [] and db.hlen(keys.IN_HAND) == 0
    assert messages_for(db, job.id) == 1


def test_a_take_asked_again_after_its_job_was_swept_takes_nothing(
    service: PlacementService, db: redis.Redis
) -> None:
    job = JobRequest(model="tiny", prompt="hi", submitted_at=1.0)
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    survivor.parked.park(job, score=1.0)
    assert service.parked.claim(job.id) is not None  # then Redis is cut off from it
    token = service.hands.hand_over(job.id)  # as HeldJobs keeps it, to ask again
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 1
    assert service.hands.take("parked", job.id, token) is None  # cut off no more
    assert survivor.parked.ids() == [job.id] and db.hlen(keys.IN_HAND) == 0


def test_a_send_whose_answer_is_lost_on_its_last_try_is_not_failed(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked job retried after two failed placements: its send step runs and its answer
    is lost. Failing it as a third error would give it an error and a run: it is sent, and
    a holder told to end it anyway (it is sent) leaves it be."""
    job = JobRequest(model="tiny", prompt="hi", submitted_at=1.0)
    service.parked.park(job, 1.0, errors=MAX_PLACEMENT_ERRORS - 1)
    send = service.hands._sent

    def sent_then_lost(*args: object, **kwargs: object) -> None:
        send(*args, **kwargs)
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(service.hands, "_sent", sent_then_lost)
    with service.held.takes():
        claimed = service.parked.claim(job.id)
    assert claimed is not None and claimed.errors == MAX_PLACEMENT_ERRORS - 1
    token = service.hands.token(job.id)
    outcome = service._attempt(claimed.job, time.perf_counter_ns(), 1.0, claimed.errors)
    monkeypatch.undo()
    assert "device" in outcome and messages_for(db, job.id) == 1
    assert not db.exists(keys.job_chunks(job.id))  # no error chunk
    service.hands.adopt(job.id, token)  # the same take, asked to end it: it is sent
    assert not service.hands.ending(job.id)


@pytest.mark.parametrize("undo_fails", [False, True], ids=["undo-answers", "undo-fails"])
def test_a_send_whose_answer_is_lost_is_neither_parked_nor_sent_twice(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch, undo_fails: bool
) -> None:
    """The send step ran (record, message and letting go at once) and its answer never
    came, while the process stalled past the TTL and another one's sweep found nothing of
    it to take: the job stays sent, once, whether the undo that follows finds it sent or
    fails too (then the job is parked, and parking finds it sent by its custody record);
    parking it too would run it twice."""
    job = JobRequest(model="tiny", prompt="hi", submitted_at=1.0)
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    send = service.hands._sent

    def sent_then_stalls(*args: object, **kwargs: object) -> None:
        send(*args, **kwargs)  # asked again after a lost answer: sends nothing more
        assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # nothing held
        raise redis.ConnectionError("Connection reset by peer")

    def redis_away(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(service.hands, "_sent", sent_then_stalls)
    if undo_fails:
        monkeypatch.setattr(service.state, "unsend", redis_away)
    outcome = service.place(job.model_dump(mode="json"))
    assert ("parked" if undo_fails else "device") in outcome  # parking it let go of it
    monkeypatch.undo()
    assert survivor.parked.ids() == [] and db.hlen(keys.IN_HAND) == 0
    assert messages_for(db, job.id) == 1
    record = SentJob.model_validate_json(db.hget(keys.inflight("vgpu:fh:0"), job.id) or b"")
    assert db.hkeys(keys.runner_jobs(record.placement.runner_id)) == [record.placement.id.encode()]
    assert survivor.recovery.lost_sends(1e12) == 0  # queued: not lost
    assert survivor.recovery.lost_sends(1e12) == 0


def test_a_job_its_placement_process_died_ending_is_ended_by_another(
    service: PlacementService, db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRequest(model="no-such-model", prompt="hello", submitted_at=1.0)
    monkeypatch.setattr(service_module, "publish_final", killed)  # dies as it ends it
    with pytest.raises(Killed):
        service.place(job.model_dump(mode="json"))
    monkeypatch.undo()
    survivor, ttl = another(service, db), service.settings.device_ttl_s
    assert survivor.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # not run: ended
    error = final_error(db, job.id)
    assert error["code"] == "job_failed" and "as it was ending it" in error["message"]
    assert survivor.parked.ids() == [] and db.hlen(keys.IN_HAND) == 0
    # ended in the sweep's own step: never held by nobody and not ended
    assert db.hget(keys.job_custody(job.id), "state") == b"failed"
    assert [str(p) for p in fsck.problems(fsck.read(db), settled=True)] == []


def test_a_held_entry_that_does_not_parse_ends_its_job_when_its_holder_is_gone(
    service: PlacementService, db: redis.Redis
) -> None:
    db.hset(keys.IN_HAND, "placement-gone-1|garbled", b"\xff not json")
    ttl = service.settings.device_ttl_s
    assert service.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # nothing put back
    error = final_error(db, "garbled")
    assert error["code"] == "job_failed" and "cannot be read" in error["message"]
    assert db.hlen(keys.IN_HAND) == 0


def test_a_job_redis_gives_back_to_a_holder_that_let_go_of_it_is_put_back(
    service: PlacementService, db: redis.Redis
) -> None:
    """Redis restored from an older snapshot holds a job in the hands of a live placement
    process that let go of it long ago: no other process sweeps it (its holder beats), so
    the holder's own look puts it back, once, and its own threads, finding it swept, do
    nothing more with it."""
    job = JobRequest(model="m", prompt="hello", submitted_at=1.0)
    hands = service.state.hands
    record = parked_record(job.model_dump(mode="json"), 1.0)
    assert hands.claim(job.id, "delivery", 600, record)[0]
    token = hands.hand_over(job.id)  # as a snapshot from before it let go of the job has it
    ttl = service.settings.device_ttl_s
    db.zadd(keys.PLACEMENT_ALIVE, {hands.name: time.time() + 3600})  # its holder beats
    assert another(service, db).recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # alive
    assert service.recovery.dead_hands(time.time() + ttl + 1, ttl) == 1
    assert service.parked.ids() == [job.id] and db.hlen(keys.IN_HAND) == 0
    assert service.recovery.dead_hands(time.time() + ttl + 1, ttl) == 0  # once
    hands.adopt(job.id, token)  # a thread that did still decide on it: swept from it
    assert hands.put_back("parked", job.id, record) is not PutBack.PUT_BACK
    assert service.parked.ids() == [job.id]

"""A job recorded live and held nowhere (scheduler/store/whereabouts.py): what one look at a
real Redis finds for each state, and when a reader's looks call the job lost."""

from __future__ import annotations

import json

import pytest
import redis

from scheduler.errors import JobLost
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import keys, whereabouts
from scheduler.store.scripts import script
from scheduler.store.whereabouts import Found, Whereabouts, look_if_due
from tests.conftest import send
from tests.test_state import GIB, ClusterState, vgpu


def record(
    db: redis.Redis, job_id: str, state: str, holder: str = "", epoch: int = 3, device: str = ""
) -> None:
    at = f"{epoch}|{device}" if device else ""  # as the move that wrote the device writes it
    fields = {"state": state, "holder": holder, "epoch": epoch, "device": at}
    db.hset(keys.job_custody(job_id), mapping=fields)


def one_look(db: redis.Redis, job_id: str, monkeypatch: pytest.MonkeyPatch) -> Whereabouts:
    """A reader's first look, at once."""
    monkeypatch.setattr(whereabouts, "LOOK_EVERY_S", 0.0)
    return look_if_due(db, lambda: db, job_id, look_if_due(db, lambda: db, job_id, None))


def test_a_look_finds_each_state_s_place(db: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    record(db, "held", "placing", "p1")
    db.hset(keys.IN_HAND, "p1|held", "{}")
    record(db, "held-by-another", "placing", "p2")
    db.hset(keys.IN_HAND, "p1|held-by-another", "{}")
    record(db, "parked", "parked")
    db.zadd(keys.PARKED, {"parked": 1.0})
    record(db, "parked-nowhere", "parked", epoch=7)
    record(db, "orphaned", "orphaned")
    db.hset(keys.ORPHANS, "orphaned", "{}")
    record(db, "orphaned-nowhere", "orphaned")
    record(db, "sent", "sent", "placement-1", device="vgpu:h:0")
    db.hset(keys.inflight("vgpu:h:0"), "sent", "{}")
    record(db, "running-nowhere", "running", "placement-2", device="vgpu:h:1")
    record(db, "sent-by-an-older-version", "sent", "placement-3")  # no device recorded
    record(db, "moved-by-an-older-version", "sent", "placement-4", epoch=3)
    db.hset(keys.job_custody("moved-by-an-older-version"), "device", "2|vgpu:h:1")
    db.hset(keys.inflight("vgpu:h:1"), "moved-by-an-older-version", "{}")
    record(db, "device-unbound", "sent", "placement-5")
    db.hset(keys.job_custody("device-unbound"), "device", "vgpu:h:1")
    record(db, "done", "done")
    ids = [
        "held",
        "held-by-another",
        "parked",
        "parked-nowhere",
        "orphaned",
        "orphaned-nowhere",
        "sent",
        "running-nowhere",
        "sent-by-an-older-version",
        "moved-by-an-older-version",
        "device-unbound",
        "done",
        "never-placed",
    ]
    # what the script answers, read apart from a reader (whose look swallows Redis's errors)
    answers = {
        job_id: Found.of(script(db, "whereabouts")(*whereabouts._args(job_id))) for job_id in ids
    }
    assert answers == {
        "held": Found("placing", "3", 1),
        "held-by-another": Found("placing", "3", 0),
        "parked": Found("parked", "3", 1),
        "parked-nowhere": Found("parked", "7", 0),
        "orphaned": Found("orphaned", "3", 1),
        "orphaned-nowhere": Found("orphaned", "3", 0),
        "sent": Found("sent", "3", 1, "vgpu:h:0"),
        "running-nowhere": Found("running", "3", 0, "vgpu:h:1"),
        "sent-by-an-older-version": Found("sent", "3", -1),
        # a device written at another epoch, or with none, says nothing of where it is now
        "moved-by-an-older-version": Found("sent", "3", -1),
        "device-unbound": Found("sent", "3", -1),
        "done": Found("done", "3", -1),
        "never-placed": Found("", "", -1),
    }
    # a reader's look keeps only a finding of nowhere
    kept = {job_id: one_look(db, job_id, monkeypatch).last for job_id in ids}
    assert kept == {job_id: a if a.held == 0 else None for job_id, a in answers.items()}


def test_a_reader_s_second_look_at_a_job_still_nowhere_loses_it(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(db, "j1", "parked", epoch=4)
    where = one_look(db, "j1", monkeypatch)
    with pytest.raises(JobLost) as lost:
        look_if_due(db, lambda: db, "j1", where)
    assert str(lost.value) == (
        "job j1 is lost: its custody record says parked (epoch 4), but ggufq:parked does not "
        "hold it, at two looks at least 0 s apart, and nothing will move it on (a bug, or "
        "Redis's data edited by hand: run `ggufq fsck`); submit it again as a new job (this "
        "id stays taken while its record is kept)"
    )


def test_a_job_whose_stream_ended_is_not_lost(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An orphan found finished is let go of where it was taken in hand: its record says
    placing, and its readers take its end from its stream."""
    record(db, "j1", "placing", "p1")
    db.xadd(keys.job_chunks("j1"), {"c": json.dumps({"seq": 1, "response": "a"})})
    where = one_look(db, "j1", monkeypatch)
    with pytest.raises(JobLost):  # its last chunk is not a final one
        look_if_due(db, lambda: db, "j1", where)
    db.xadd(keys.job_chunks("j1"), {"c": json.dumps({"seq": 2, "done": True})})
    for _ in range(3):
        where = look_if_due(db, lambda: db, "j1", where)
    assert where.last is None  # its end is in its stream: not a place to look for it


def test_a_job_that_moved_between_looks_is_not_lost(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(db, "j1", "parked", epoch=4)
    where = one_look(db, "j1", monkeypatch)
    record(db, "j1", "placing", "p1", epoch=5)  # taken, and its hold lost: nowhere again
    where = look_if_due(db, lambda: db, "j1", where)  # a new finding, not the last one again
    db.hset(keys.IN_HAND, "p1|j1", "{}")
    where = look_if_due(db, lambda: db, "j1", where)  # held: found
    db.hdel(keys.IN_HAND, "p1|j1")
    where = look_if_due(db, lambda: db, "j1", where)  # nowhere once, after it was found
    assert where.last == Found("placing", "5", 0)


def test_looks_come_every_look_every_s_from_the_reader_s_first_check() -> None:
    every = whereabouts.LOOK_EVERY_S
    where = Whereabouts("j1", now=100.0)
    assert not where.turn(100.0 + every - 0.1)
    assert where.turn(100.0 + every)
    assert not where.turn(100.0 + 2 * every - 0.1)  # a turn taken: the next is a look on
    assert not where.seen(Found("parked", "1", 0))
    assert where.turn(300.0)
    assert where.seen(Found("parked", "1", 0))


def test_a_look_redis_does_not_answer_changes_nothing(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(db, "j1", "parked")
    where = one_look(db, "j1", monkeypatch)
    away = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
    assert look_if_due(away, lambda: away, "j1", where) is where
    assert where.last == Found("parked", "3", 0)


def test_a_stream_that_moved_on_between_looks_is_not_lost(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(db, "j1", "running", "p1", device="vgpu:h:0")  # its in-flight record lost
    db.xadd(keys.job_chunks("j1"), {"c": json.dumps({"seq": 1, "response": "a"})}, id="0-1")
    where = one_look(db, "j1", monkeypatch)
    db.xadd(keys.job_chunks("j1"), {"c": json.dumps({"seq": 2, "response": "b"})}, id="0-2")
    where = look_if_due(db, lambda: db, "j1", where)  # its run wrote on: not lost yet
    assert where.last == Found("running", "3", 0, "vgpu:h:0", "0-2")
    with pytest.raises(JobLost, match=r"says running \(epoch 3\), but ggufq:inflight:vgpu:h:0"):
        look_if_due(db, lambda: db, "j1", where)


def test_a_job_sent_and_started_is_found_on_its_device(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps that send and start a job record its device, where a look finds it."""
    state = ClusterState(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)
    job = JobRequest(model="m", prompt="p")
    placed = Placement(id="p1", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    assert send(state, SentJob(job=job, placement=placed, worker="w@h"))
    assert db.hget(keys.job_custody(job.id), "device") == b"1|vgpu:h:0"
    assert one_look(db, job.id, monkeypatch).last is None
    assert state.start("vgpu:h:0", job.id, "p1", "d1", now=101.0) is False
    assert db.hmget(keys.job_custody(job.id), "state", "device") == [b"running", b"2|vgpu:h:0"]
    db.hdel(keys.inflight("vgpu:h:0"), job.id)  # as a hand's edit would
    assert one_look(db, job.id, monkeypatch).last == Found("running", "2", 0, "vgpu:h:0")
    # a move by a version that writes no device raises the epoch and leaves the field:
    # it no longer says where the job is, and no look trusts it
    db.hset(keys.job_custody(job.id), mapping={"state": "sent", "epoch": 3, "holder": "p2"})
    assert one_look(db, job.id, monkeypatch).last is None


def test_a_stream_entry_that_does_not_parse_still_counts_as_its_progress(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(db, "j1", "parked")
    db.xadd(keys.job_chunks("j1"), {"c": b"\xff not json"}, id="0-1")
    where = one_look(db, "j1", monkeypatch)
    assert where.last == Found("parked", "3", 0, "", "0-1")
    db.xadd(keys.job_chunks("j1"), {"c": b"[1, 2]"}, id="0-2")  # JSON, not a chunk
    where = look_if_due(db, lambda: db, "j1", where)
    assert where.last == Found("parked", "3", 0, "", "0-2")

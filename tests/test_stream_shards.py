"""Token streams on Redis instances of their own (issue 38, GGUFQ_STREAM_REDIS_URLS): each
job's stream on the instance a hash of its id picks, fenced there as the custody record
fences it where the two live together, and a whole stack serving over them."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from api_client import AsyncClient, Client
from scheduler.errors import BadSettings, GgufqError
from scheduler.local.embedded import EmbeddedRedis
from scheduler.local.stack import LocalStack
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.redis_urls import split_urls
from scheduler.settings import Settings
from scheduler.store import fsck, keys
from scheduler.store.clock import redis_now
from scheduler.store.connection import connect
from scheduler.store.hands import Hands
from scheduler.store.placement_state import PlacementState
from scheduler.store.shards import Shards, shard_of, stream_shards
from scheduler.store.streams import (
    Appended,
    claim_stream,
    error_chunk,
    pay_owed,
    publish_final,
    write_chunk,
)
from scheduler.store.worker_state import WorkerState
from tests.conftest import send, settings_from, stack_env, wait_for
from tests.held_worker import is_held, release
from tests.test_faults import held_hosts
from tests.test_midstream import GREEDY, one_stream
from tests.test_state import vgpu
from workers import chunks as chunks_module
from workers.chunks import ChunkWriter
from workers.pending import Pending
from workers.publisher import ChunkPublisher


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EmbeddedRedis]]:
    """Two redis-servers for streams, beside the session's."""
    root = tmp_path_factory.mktemp("stream-redis")
    servers = [EmbeddedRedis(root / str(n)) for n in range(2)]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture()
def apart(instances: list[EmbeddedRedis]) -> Iterator[list[redis.Redis]]:
    clients = [redis.Redis.from_url(s.url) for s in instances]
    for client in clients:
        client.flushall()
    yield clients
    for client in clients:
        client.close()


def test_a_job_s_instance_is_the_same_everywhere_and_they_share_the_jobs() -> None:
    assert shard_of("job-1", 3) == shard_of("job-1", 3)  # crc32: no per-process seed
    counts = [0, 0, 0]
    for n in range(3000):
        counts[shard_of(f"{n:032x}", 3)] += 1
    assert all(900 < c < 1100 for c in counts), counts
    assert Shards("control").of("x") == "control" and not Shards("control").sharded
    assert Shards("c", ["a", "b"]).all == ["a", "b"]


def test_the_setting_takes_sentinel_urls_and_refuses_a_cluster() -> None:
    given = "redis://a:1/0, redis+sentinel://s1:26379,s2:26379/0?master=m ,rediss://b:2/1"
    assert split_urls(given) == [
        "redis://a:1/0",
        "redis+sentinel://s1:26379,s2:26379/0?master=m",
        "rediss://b:2/1",
    ]
    assert Settings(stream_redis_urls=given).stream_redis_urls.count("://") == 3
    with pytest.raises(ValidationError, match="Redis Cluster is not supported"):
        Settings(stream_redis_urls="redis://a:1/0,redis+cluster://b:2")
    with pytest.raises(ValidationError, match="names GGUFQ_REDIS_URL's Redis"):
        Settings(redis_url="redis://Ctl:6379/0", stream_redis_urls="redis://a:1,redis://ctl")


def test_every_process_is_given_the_instances_placement_serves(
    db: redis.Redis, instances: list[EmbeddedRedis]
) -> None:
    urls = ",".join(s.url for s in instances)
    placed = stream_shards(db, urls, connect, placement=True)
    assert len(placed.others) == 2
    agreed = stream_shards(db, urls, connect)  # the same list
    assert agreed.sharded
    reversed_ = ",".join(s.url for s in reversed(instances))
    with pytest.raises(BadSettings, match="give every process the same list"):
        stream_shards(db, reversed_, connect)
    with pytest.raises(BadSettings, match="GGUFQ_STREAM_REDIS_URLS names the stream instances"):
        stream_shards(db, "", connect)  # a worker given none: its streams would be here
    # the same instances, named otherwise (the default database left out): agreed
    named = stream_shards(db, ",".join(s.url.removesuffix("/0") for s in instances), connect)
    kwargs = db.connection_pool.connection_kwargs
    url = f"redis://127.0.0.1:{kwargs['port']}/1"
    with Client(url, settings=Settings()) as reader:  # given none: fine until it reads one
        with pytest.raises(BadSettings, match="give every process the same list"):
            reader.streams.check()
    with Client(url, settings=Settings(stream_redis_urls=urls)) as reader:  # ggufq fsck's
        found = reader.streams.by_address()
        assert list(found) == [f"127.0.0.1:{s.port}/0" for s in instances]
        assert [c.connection_pool.connection_kwargs["port"] for c in found.values()] == [
            s.port for s in instances
        ]
    for client in [*placed.others, *agreed.others, *named.others]:
        client.close()


def _sent(db: redis.Redis, placement_id: str) -> tuple[JobRequest, Placement]:
    job = JobRequest(model="m", prompt="p")
    placed = Placement(
        id=placement_id, runner_id="r", device_id="vgpu:h:0", config=RunnerConfig(512)
    )
    assert send(PlacementState(db), SentJob(job=job, placement=placed, worker="w@h"))
    return job, placed


def test_a_run_taken_back_is_refused_its_chunks_on_the_stream_s_instance(
    db: redis.Redis, apart: list[redis.Redis]
) -> None:
    streams = Shards(db, apart)
    workers, placement = WorkerState(db, streams), PlacementState(db, Hands(db, "p", streams))
    workers.register_device(vgpu(0))
    job, first = _sent(db, "p1")
    stream, custody = streams.of(job.id), keys.job_custody(job.id)
    assert workers.start("vgpu:h:0", job.id, "p1", "d1", 1.0) is False
    assert workers.claim_stream(job.id, "p1") == 0
    assert stream.ttl(keys.job_custody(job.id)) > 86400  # a custody record's life, not an hour
    assert write_chunk(stream, job.id, 1, {"response": "a"}, 60, "p1") is Appended.WRITTEN
    assert stream.xlen(keys.job_chunks(job.id)) == 1
    assert not db.exists(keys.job_chunks(job.id))  # the control Redis holds no stream
    stale_epoch = int(db.hget(custody, "epoch") or 0)

    # placement takes the job from its run (its worker stalled past its lease): the
    # stream's record names no holder from the read on, so the run adds nothing after it
    db.hset(custody, mapping={"state": "placing", "holder": "p", "epoch": stale_epoch + 1})
    db.hset(custody, mapping={"token": "hold-1", "swept": ""})  # as lua/take.lua holds it
    placement.hands.adopt(job.id, "hold-2")  # a hold swept from this process: not its job
    assert placement.fenced_progress(job.id) is None
    placement.hands.adopt(job.id, "hold-1")
    assert placement.fenced_progress(job.id) == (1, False)
    assert write_chunk(stream, job.id, 2, {"response": "b"}, 60, "p1") is Appended.FENCED
    assert workers.claim_stream(job.id, "p1") is None  # the run, come back: not its job

    # it goes on under placement p2, whose run claims the stream under its later epoch
    again = first.model_copy(update={"id": "p2"})
    sent_again = SentJob(job=job, placement=again, worker="w@h").model_dump_json()
    db.hset(keys.inflight("vgpu:h:0"), job.id, sent_again)
    db.hset(custody, mapping={"state": "sent", "holder": "p2"})
    assert workers.start("vgpu:h:0", job.id, "p2", "d2", 1.0) is False
    assert workers.claim_stream(job.id, "p2") == 1  # the chunk there: the first run's
    assert write_chunk(stream, job.id, 2, {"response": "c"}, 60, "p2") is Appended.WRITTEN
    # a claim of the first run's, made late under its own epoch, changes nothing
    assert claim_stream(stream, job.id, "p1", stale_epoch) == -2
    assert write_chunk(stream, job.id, 3, {"response": "d"}, 60, "p1") is Appended.FENCED

    # the end: the custody record moves on the control Redis, then the final chunk here
    last = (3, {"done": True, "response": ""})
    assert workers.end(first, job.id, last, 2.0, None, 60) == (Appended.FENCED, -1)
    assert stream.xlen(keys.job_chunks(job.id)) == 2
    assert workers.end(again, job.id, last, 2.0, None, 60)[0] is Appended.WRITTEN
    assert db.hget(custody, "state") == b"done" and not db.zcard(keys.DUE_FINAL)
    assert stream.xlen(keys.job_chunks(job.id)) == 3
    assert claim_stream(stream, job.id, "p3", 99) == -1  # ended: nothing to claim
    # a second final chunk of another outcome is refused there, and fsck reads it there
    failed = {"done": True, "error": "late", "response": ""}
    assert write_chunk(stream, job.id, 4, failed, 60, "p2") is Appended.FENCED
    named = {f"127.0.0.1:{c.connection_pool.connection_kwargs['port']}/0": c for c in apart}
    where = next(name for name, c in named.items() if c is stream)
    census = fsck.read(db, named)
    assert census.refused == {f"done -> failed on the stream instance {where}": 1}
    assert fsck.read(db).refused == {}  # the control Redis refused nothing
    # an instance that does not answer is named, and what the others hold still counts
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = redis.Redis(port=closed.getsockname()[1])
    census = fsck.read(db, {**named, "gone:1/0": gone})
    assert census.refused == {f"done -> failed on the stream instance {where}": 1}
    assert [str(p) for p in fsck.problems(census) if "gone:1/0" in str(p)] == [
        "custody: the stream instance gone:1/0 of GGUFQ_STREAM_REDIS_URLS could not be read: "
        + census.unread["gone:1/0"]
    ]


def test_placement_s_end_of_a_job_writes_its_chunk_on_the_instance(
    db: redis.Redis, apart: list[redis.Redis]
) -> None:
    streams = Shards(db, apart)
    job_id = "ended-unrun"
    exc = GgufqError("no such model")
    publish_final(db, job_id, error_chunk("m", job_id, exc), 60, streams)
    assert db.hget(keys.job_custody(job_id), "state") == b"failed"
    stream = streams.of(job_id)
    [(_id, fields)] = stream.xrange(keys.job_chunks(job_id))
    assert b"no such model" in fields[b"c"]
    # a run that turns up later writes nothing after the end
    assert write_chunk(stream, job_id, 2, {"response": "x"}, 60, "p1") is Appended.FENCED


def test_a_stack_streams_over_two_instances(
    models_dir: Path, tmp_path: Path, instances: list[EmbeddedRedis], apart: list[redis.Redis]
) -> None:
    env = stack_env(models_dir, tmp_path / "state", host="shardhost")
    env["GGUFQ_STREAM_REDIS_URLS"] = ",".join(s.url for s in instances)
    settings = settings_from(env, None)
    with LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env) as stack:
        with Client(stack.redis_url, settings=settings, timeout=120) as client:
            names = [f"{uuid.uuid4().hex[:8]}-{n}" for n in range(40)]
            ids = [i for i in names if shard_of(i, 2) == 0][:3]
            ids += [i for i in names if shard_of(i, 2) == 1][:3]
            for n, job_id in enumerate(ids):
                job = client.submit("tiny", f"count {n}", options={"num_predict": 6}, id=job_id)
                text = "".join(c.response for c in job.stream() if not c.done)
                assert text == job.result().response and job.result().done
            assert not client.r.keys("ggufq:job:*:chunks")  # none on the control Redis
            where = [streams for streams in apart if streams.keys("ggufq:job:*:chunks")]
            assert len(where) == 2  # six jobs over both instances
            for job_id in ids:
                assert apart[shard_of(job_id, 2)].exists(keys.job_chunks(job_id))
            [runner] = client.ps()  # each end recorded before its reader saw it
            assert runner.in_flight == 0
            with pytest.raises(GgufqError, match="alien"):  # placement's end, on an instance
                client.generate("alien", "hi")

        async def over_asyncio() -> str:
            async with AsyncClient(stack.redis_url, settings=settings, timeout=120) as aclient:
                job = await aclient.submit("tiny", "async", options={"num_predict": 4})
                parts = [chunk.response async for chunk in job.stream() if not chunk.done]
                return "".join(parts)

        assert asyncio.run(over_asyncio())


def test_a_stream_instance_restarted_mid_stream_loses_nothing(
    models_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The instance of a job held after its first text stops and starts again (its data
    kept, as a restart or a failover keeps it): the worker holds its chunks back meanwhile,
    the reader reads on from its last chunk, and the answer is whole, once."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("one-stream-redis"))
    server.start()
    env = stack_env(models_dir, tmp_path / "state", host="shardfault")
    env["GGUFQ_STREAM_REDIS_URLS"] = server.url
    settings = settings_from(env, None)
    try:
        with LocalStack(
            settings, log_dir=tmp_path / "logs", extra_env=env, worker_module="tests.held_worker"
        ) as stack:
            with Client(stack.redis_url, settings=settings, timeout=120) as client:
                job = client.submit("tiny", "HOLD: go on", options={"num_predict": 12})
                stream = job.stream()
                first = next(stream)
                assert first.response and not first.done
                shard = redis.Redis.from_url(server.url)
                assert wait_for(lambda: is_held(shard, job.id))
                shard.close()
                server.stop()
                server.start()
                shard = redis.Redis.from_url(server.url)
                release(shard, job.id)
                rest = list(stream)
                shard.close()
                assert rest[-1].done
                text = first.response + "".join(c.response for c in rest if not c.done)
                assert text == job.result().response
                seqs = [first.seq, *(c.seq for c in rest)]
                assert seqs == list(range(1, len(seqs) + 1))  # none lost, none twice
    finally:
        server.stop()


def test_a_final_chunk_its_writer_left_owed_is_written_by_placement_s_look(
    db: redis.Redis, apart: list[redis.Redis]
) -> None:
    """A worker killed between its end (on the control Redis) and its final chunk (on the
    stream's instance, or that instance away): the chunk waits in the job's record, due,
    and placement's look writes it, so the job's reader does not wait for it in vain."""
    with socket.socket() as closed:  # a port nothing listens on: the writer "dies" there
        closed.bind(("127.0.0.1", 0))
        gone = redis.Redis(port=closed.getsockname()[1])
    dying = WorkerState(db, Shards(db, [gone, gone]))
    dying.register_device(vgpu(0))
    job, placed = _sent(db, "p1")
    assert dying.start("vgpu:h:0", job.id, "p1", "d1", 1.0) is False
    last = (1, {"done": True, "response": "all"})
    # the stream's Redis does not take the chunk: it stays owed, the end is written
    assert dying.end(placed, job.id, last, 2.0, None, 60)[0] is Appended.WRITTEN
    assert db.hget(keys.job_custody(job.id), "state") == b"done"  # the end is recorded
    assert db.zscore(keys.DUE_FINAL, job.id) is not None
    owed = f"job {job.id}: owes its stream's Redis its final chunk once settled"
    assert owed in [str(p) for p in fsck.problems(fsck.read(db), settled=True)]

    # placement failing the job meanwhile (its worker looked lost) owes nothing over it
    failed = error_chunk("m", job.id, GgufqError("lost"))
    publish_final(db, job.id, failed, 60, Shards(db, [gone, gone]))
    streams = Shards(db, apart)
    assert pay_owed(db, streams, redis_now(db) + 1, 60) == 1
    [(_id, fields)] = streams.of(job.id).xrange(keys.job_chunks(job.id))
    assert json.loads(fields[b"c"]) == {"done": True, "response": "all", "seq": 1}
    assert not db.zcard(keys.DUE_FINAL) and not db.hexists(keys.job_custody(job.id), "owed")
    assert pay_owed(db, streams, redis_now(db) + 1, 60) == 0  # paid once
    assert owed not in [str(p) for p in fsck.problems(fsck.read(db), settled=True)]

    # placement's own end of a job that never ran owes its chunk the same way
    ended = Shards(db, [gone, gone])
    publish_final(db, "unrun", error_chunk("m", "unrun", GgufqError("no")), 60, ended)
    assert pay_owed(db, streams, redis_now(db) + 1, 60) == 1
    [(_id, fields)] = streams.of("unrun").xrange(keys.job_chunks("unrun"))
    assert json.loads(fields[b"c"])["error"]["message"] == "no"
    # written again (its payer died before saying so): no second final chunk
    db.hset(keys.job_custody("unrun"), "owed", json.dumps({"done": True, "error": "x"}))
    db.zadd(keys.DUE_FINAL, {"unrun": 0})
    assert pay_owed(db, streams, redis_now(db) + 1, 60) == 1
    assert streams.of("unrun").xlen(keys.job_chunks("unrun")) == 1
    gone.close()


def test_each_instance_s_chunks_go_out_in_order_on_its_own_lane(
    db: redis.Redis, apart: list[redis.Redis]
) -> None:
    """A job's first chunk goes to its stream's instance from the publishing thread
    (workers/first_chunk.py), its answer read by that instance's writing thread before
    the job's later chunks go out there: two jobs on two instances, each stream whole and
    in order where it lives, nothing on the control Redis."""
    writer = ChunkWriter(Shards(db, apart), interval_s=600.0)  # only a flush hurries it
    jobs = [next(f"j{n}" for n in range(99) if shard_of(f"j{n}", 2) == i) for i in (0, 1)]
    try:
        pubs = [ChunkPublisher(db, job_id, ttl_s=60, writer=writer) for job_id in jobs]
        for word in ("first ", "then ", "last"):
            for pub in pubs:
                pub.publish({"response": word})
                pub.publish({"thinking": word})  # another kind: a chunk of its own
        for pub, stream in zip(pubs, apart, strict=True):
            assert pub.last_seq() == 7  # its lane flushed: every chunk before its end
            chunks = [json.loads(f[b"c"]) for _, f in stream.xrange(keys.job_chunks(pub.job_id))]
            assert [c["seq"] for c in chunks] == [1, 2, 3, 4, 5, 6]
            assert "".join(c.get("response", "") for c in chunks) == "first then last"
            assert not db.exists(keys.job_chunks(pub.job_id))
    finally:
        writer.close()


def writer_with_one_away(
    db: redis.Redis, up: redis.Redis
) -> tuple[ChunkWriter, redis.Redis, str, str]:
    """A writer over two stream instances, ``up`` and one whose port refuses, its outage
    bound 600 s; the client of the one away, and a job id on each (up's first)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = redis.Redis(port=closed.getsockname()[1])
    here = next(f"j{n}" for n in range(99) if shard_of(f"j{n}", 2) == 0)
    there = next(f"j{n}" for n in range(99) if shard_of(f"j{n}", 2) == 1)
    return ChunkWriter(Shards(db, [up, gone]), outage_s=600), gone, here, there


def test_a_stream_instance_away_holds_back_its_own_chunks_only(
    db: redis.Redis, apart: list[redis.Redis]
) -> None:
    writer, gone, here, there = writer_with_one_away(db, apart[0])
    try:
        for job_id in (there, here):  # the instance away's chunk first
            writer.put(job_id, 1, {"response": job_id}, 60)
        # the chunks of a job on the instance that answers go out, and its end's flush
        # returns, while the other instance's chunk waits for its Redis to come back
        assert writer.flush(timeout_s=10, job_id=here)
        assert apart[0].xlen(keys.job_chunks(here)) == 1
        writer.put(here, 2, {"response": "and on"}, 60)
        assert writer.flush(timeout_s=10, job_id=here)
        assert apart[0].xlen(keys.job_chunks(here)) == 2
        assert not writer.flush(timeout_s=0.2)  # all of them: the chunk held back is not
        writer.outage_s = 0.5  # its Redis away past the bound: given up on, the others kept
        assert writer.flush(timeout_s=10)
        assert apart[0].xlen(keys.job_chunks(here)) == 2
    finally:
        writer.outage_s = 0.0  # nothing left retrying after the test
        writer.close()
        gone.close()


def test_closing_lets_go_of_an_instance_away_within_its_timeout(
    db: redis.Redis, apart: list[redis.Redis], caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that stops while a stream instance is away does not leave that lane's
    thread retrying for the outage bound (600 s here): close gives up on its chunks (their
    readers get ChunksLost) once its timeout has passed and the try under way has failed
    (redis-py's own retries make a try to a refused port last some 3-4 s), and chunks
    queued behind them are given up on without a try; the other instance's are written."""
    writer, gone, here, there = writer_with_one_away(db, apart[0])
    try:
        first = writer.put(there, 1, {"response": there}, 60)
        writer.put(here, 1, {"response": here}, 60)
        assert not writer.flush(timeout_s=0.2)  # held back for the instance away
        taken_by = time.monotonic() + 60  # a bound for a stuck test only
        while not first.taken:  # its lane took it: what comes next is a batch of its own
            assert time.monotonic() < taken_by, "the lane never took the first chunk"
            time.sleep(0.01)
        writer.put(there, 2, {"response": "and on"}, 60)
        writer.close(timeout_s=0.5)
        for lane in writer._lanes.values():
            lane.thread.join(timeout=60)  # a bound for a stuck test, not a wait on slowness
            assert not lane.thread.is_alive()
        assert apart[0].xlen(keys.job_chunks(here)) == 1
        gave_up = [r.getMessage() for r in caplog.records if "gave up writing" in r.getMessage()]
        assert len(gave_up) == 2 and all("the writer is closing" in m for m in gave_up)
        assert f"chunks of jobs {there} after 0 tries" in gave_up[1]
    finally:
        writer.close(timeout_s=0)  # nothing left retrying, whatever failed above
        gone.close()


def test_closing_still_tries_a_redis_that_was_away_before_it_began(db: redis.Redis) -> None:
    """Only an outage seen since close began lets a closing lane give up without a try: a
    lane whose Redis was away earlier, and is back, writes what it holds, however short
    close's timeout."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = redis.Redis(port=closed.getsockname()[1])
    writer = ChunkWriter(gone, interval_s=600.0, outage_s=0.0)  # only flush, close hurry
    (lane,) = writer._lanes.values()
    try:
        writer.put("lost", 1, {"response": "in the outage"}, 60)
        assert writer.flush(timeout_s=60)  # tried, found away, given up on
        lane.r = db  # its Redis is back (at the same address, as a restart is)
        lane.hurry.clear()  # the flush's, if the lane took its batch before it was set
        writer.put("kept", 2, {"response": "after it"}, 60)  # seq 2: no hurry
        writer.close(timeout_s=0)  # "kept" and the end go out in one batch
        lane.thread.join(timeout=60)  # a bound for a stuck test, not a wait on slowness
        assert not lane.thread.is_alive()
        assert db.xlen(keys.job_chunks("kept")) == 1
    finally:
        writer.close(timeout_s=0)
        gone.close()


def until(done: Callable[[], bool]) -> None:
    """Wait for ``done`` (a bound for a stuck test only, not a wait on slowness)."""
    bound = time.monotonic() + 60
    while not done():
        assert time.monotonic() < bound
        time.sleep(0.01)


def test_a_closing_lane_whose_redis_came_back_tries_what_comes_next(db: redis.Redis) -> None:
    """Only the last try's outage counts: a lane that found its Redis away after close
    began, and then wrote to it again, still tries the batch behind (a recording stand-in
    for one try: the first finds Redis away once close has begun, the second writes, and
    close's deadline is passed as it does)."""
    writer = ChunkWriter(db, interval_s=600.0)
    (lane,) = writer._lanes.values()
    real, started, calls = lane._try_write, threading.Event(), []

    def one_try(chunks: list[Pending]) -> tuple[list[Pending], str | None, bool]:
        calls.append([c.job_id for c in chunks])
        if len(calls) == 1:
            started.set()
            until(lambda: writer.closing_since < float("inf"))
            return chunks, "Connection refused", True
        writer.give_up_at = min(writer.give_up_at, time.monotonic())  # past it from here
        return real(chunks)

    lane._try_write = one_try  # type: ignore[method-assign]
    try:
        writer.put("first", 1, {"response": "tried while away"}, 60)
        assert started.wait(60)
        writer.put("behind", 2, {"response": "queued behind it"}, 60)
        writer.close(timeout_s=30)
        lane.thread.join(timeout=60)  # a bound for a stuck test, not a wait on slowness
        assert not lane.thread.is_alive()
        assert calls == [["first"], ["first"], ["behind"]]
        assert db.xlen(keys.job_chunks("first")) == db.xlen(keys.job_chunks("behind")) == 1
    finally:
        writer.close(timeout_s=0)


def test_a_closing_lane_tries_once_more_a_redis_found_away_before_close(
    db: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane retrying a batch in an outage when close begins, its Redis back by then,
    tries it once more, however short close's timeout (a stand-in for one try finds Redis
    away once; the lane's pause between tries is held until close has begun)."""
    writer = ChunkWriter(db, interval_s=600.0)
    (lane,) = writer._lanes.values()
    real, pausing, calls = lane._try_write, threading.Event(), []

    class Clock:  # the writer module's time: its pause between tries outlasts close's start
        monotonic, time = staticmethod(time.monotonic), staticmethod(time.time)

        @staticmethod
        def sleep(_s: float) -> None:
            pausing.set()
            until(lambda: writer.closing_since < float("inf"))

    def one_try(chunks: list[Pending]) -> tuple[list[Pending], str | None, bool]:
        calls.append([c.job_id for c in chunks])
        return (chunks, "Connection refused", True) if len(calls) == 1 else real(chunks)

    monkeypatch.setattr(chunks_module, "time", Clock)
    lane._try_write = one_try  # type: ignore[method-assign]
    try:
        writer.put("retried", 1, {"response": "across the outage"}, 60)
        assert pausing.wait(60)  # found away once, before close
        writer.close(timeout_s=0)
        lane.thread.join(timeout=60)
        assert not lane.thread.is_alive()
        assert calls == [["retried"], ["retried"]]
        assert db.xlen(keys.job_chunks("retried")) == 1
    finally:
        writer.close(timeout_s=0)


def test_a_job_whose_worker_is_killed_goes_on_elsewhere_with_its_stream_apart(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tests/test_midstream.py's first fault with the stream on an instance of its own: the
    worker of a streaming greedy job is SIGKILLed while the job is held there; placement
    fences the stream as it takes the job back, and the run elsewhere claims it and goes
    on. The reader gets one stream, every chunk once, and the whole answer."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("resume-stream-redis"))
    server.start()
    shard = redis.Redis.from_url(server.url)
    try:
        with held_hosts(
            tmp_path, GGUFQ_FLASH_ATTENTION="false", GGUFQ_STREAM_REDIS_URLS=server.url
        ) as (st, h2, settings):
            with Client(st.redis_url, settings=settings, timeout=60) as client:
                assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
                job = client.submit("slow", "HOLD@20: the resumed answer", options=GREEDY)
                assert wait_for(lambda: is_held(shard, job.id), timeout=60)
                stream = iter(job.stream(cancel_on_close=False))
                written = shard.xlen(keys.job_chunks(job.id))
                chunks = [next(stream).model_dump() for _ in range(written)]
                h2.send_signal(signal.SIGKILL)
                h2.wait(10)
                chunks += [chunk.model_dump() for chunk in stream]
                result = job.result(timeout=60)
                assert result.done and one_stream(chunks) == result.response
                assert result.device == "vgpu:h1:0"
                (note,) = result.resumed
                assert note.device == "vgpu:h2:0" and note.chunks >= 1
                assert not client.r.exists(keys.job_chunks(job.id))  # all on the instance
    finally:
        shard.close()
        server.stop()

"""Pub/sub connections of job readers, used again: on a real Redis, through a dropped
connection and a restart of Redis."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import redis.asyncio

from scheduler.local.embedded import EmbeddedRedis
from scheduler.store import keys
from scheduler.store.streams import aread_chunks, read_chunks
from scheduler.store.subscriptions import AsyncSubscriptions, Subscriptions
from workers.chunks import ChunkPublisher

NAME = "subscriptions-test"  # the name of this test's connections, among the session's


def connections(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("name") == NAME)


def named(redis_server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis(port=redis_server.port, db=1, client_name=NAME)


def soon(check: Callable[[], bool], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def finished_job(client: redis.Redis, job_id: str, words: list[str]) -> None:
    pub = ChunkPublisher(client, job_id, ttl_s=60)
    for word in words:
        pub.publish({"response": word})
    pub.publish({"response": "", "done": True})


def texts(client: redis.Redis, job_id: str, pool: Subscriptions) -> list[str]:
    return [c["response"] for c in read_chunks(client, job_id, 20, subscriptions=pool)]


def test_readers_one_after_another_use_one_connection(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    mine = named(redis_server)
    pool = Subscriptions(mine)
    try:
        for n in range(6):
            finished_job(db, f"job-{n}", [f"w{n}"])
        assert texts(mine, "job-0", pool) == ["w0", ""]
        after_one = connections(db)
        assert after_one >= 1
        assert [texts(mine, f"job-{n}", pool) for n in range(1, 6)] == [
            [f"w{n}", ""] for n in range(1, 6)
        ]
        assert connections(db) == after_one  # no connection per job
        assert int(db.pubsub_numsub(keys.job_channel("job-5"))[0][1]) == 0  # let go
    finally:
        pool.close()
        mine.close()


def test_readers_at_once_each_get_their_own_jobs_chunks(db: redis.Redis) -> None:
    pool = Subscriptions(db)
    got: dict[str, list[str]] = {}

    def read(job_id: str) -> None:
        got[job_id] = texts(db, job_id, pool)

    try:
        readers = [threading.Thread(target=read, args=(f"live-{n}",)) for n in range(3)]
        for thread in readers:
            thread.start()
        channels = [keys.job_channel(f"live-{n}") for n in range(3)]
        assert soon(lambda: all(count for _, count in db.pubsub_numsub(*channels)))
        for n in range(3):
            finished_job(db, f"live-{n}", ["a", "b"])
        for thread in readers:
            thread.join(timeout=20)
        assert got == {f"live-{n}": ["a", "b", ""] for n in range(3)}
    finally:
        pool.close()


def test_a_connection_given_back_carries_nothing_of_its_last_job(db: redis.Redis) -> None:
    pool = Subscriptions(db)
    try:
        first = pool.open(keys.job_channel("old"))
        for n in range(3):  # chunks its reader never read
            db.publish(keys.job_channel("old"), f"late {n}")
        first.close()
        second = pool.open(keys.job_channel("new"))
        assert second.pubsub is first.pubsub  # the same connection, used again
        message = second.get_message(timeout=5)
        assert message is not None and message["type"] == "subscribe"
        assert message["channel"] == keys.job_channel("new").encode()
        assert second.get_message(timeout=0.2) is None
        second.close()
    finally:
        pool.close()


def test_a_killed_connection_is_subscribed_again_and_its_reader_misses_nothing(
    db: redis.Redis,
) -> None:
    pool = Subscriptions(db)
    try:
        pub = ChunkPublisher(db, "job-k", ttl_s=60)
        pub.publish({"response": "one"})
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.extend(
                c["response"] for c in read_chunks(db, "job-k", 20, subscriptions=pool)
            )
        )
        reader.start()
        assert soon(lambda: got == ["one"])
        db.client_kill_filter(_type="pubsub")
        pub.publish({"response": "two"})  # may be lost with the connection: the record has it
        pub.publish({"response": "", "done": True})
        reader.join(timeout=20)
        assert got == ["one", "two", ""]
    finally:
        pool.close()


def test_idle_connections_survive_a_restart_of_redis(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    pool = Subscriptions(client)
    try:
        finished_job(client, "before", ["x"])
        assert texts(client, "before", pool) == ["x", ""]  # leaves an idle connection
        server.stop()
        server.start()
        finished_job(client, "after", ["y"])
        assert texts(client, "after", pool) == ["y", ""]
    finally:
        pool.close()
        client.close()
        server.stop()


def test_async_readers_use_kept_connections_and_get_only_their_chunks(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    for n in range(4):
        finished_job(db, f"async-{n}", [f"w{n}"])

    async def main() -> tuple[list[list[str]], int, int]:
        client = redis.asyncio.Redis(port=redis_server.port, db=1, client_name=NAME)
        pool = AsyncSubscriptions(client)
        try:

            async def texts(job_id: str) -> list[str]:
                chunks = aread_chunks(client, job_id, 20, subscriptions=pool)
                return [c["response"] async for c in chunks]

            got = [await texts("async-0")]
            after_one = connections(db)
            assert after_one >= 1
            got += [await texts(f"async-{n}") for n in range(1, 4)]
            # a connection given back carries nothing of its last channel
            first = await pool.open(keys.job_channel("old"))
            await client.publish(keys.job_channel("old"), "late")
            await first.aclose()
            second = await pool.open(keys.job_channel("new"))
            message = await second.get_message(timeout=5)
            assert message is not None and message["type"] == "subscribe"
            assert message["channel"] == keys.job_channel("new").encode()
            assert await second.get_message(timeout=0.2) is None
            await second.aclose()
            return got, after_one, connections(db)
        finally:
            await pool.aclose()
            await client.aclose()

    got, after_one, after_all = asyncio.run(main())
    assert got == [[f"w{n}", ""] for n in range(4)]
    assert after_all == after_one  # no connection per job


def test_a_reader_gets_only_its_channels_messages_and_waits_its_whole_timeout(
    db: redis.Redis,
) -> None:
    pool = Subscriptions(db)
    try:
        sub = pool.open(keys.job_channel("mine"))
        first = sub.get_message(timeout=5)
        assert first is not None and first["type"] == "subscribe"
        sub.pubsub.subscribe("not-a-job-channel")  # another channel on the same connection
        db.publish("not-a-job-channel", "stray")
        db.publish(keys.job_channel("mine"), "chunk")
        message = sub.get_message(timeout=5)
        assert message is not None and message["data"] == b"chunk"
        started = time.monotonic()
        db.publish("not-a-job-channel", "stray again")
        assert sub.get_message(timeout=0.5) is None
        assert time.monotonic() - started >= 0.45  # not cut short by the stray message
        sub.pubsub.unsubscribe("not-a-job-channel")
        sub.close()
    finally:
        pool.close()

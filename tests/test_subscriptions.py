"""Pub/sub connections of job readers, used again: on a real Redis, through a dropped
connection and a restart of Redis."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from api_client import Client
from scheduler.local.embedded import EmbeddedRedis
from scheduler.protocol import JobRequest
from scheduler.store import keys
from scheduler.store.cancel import READER_STUCK_S, ReaderLease, cancelled_by, watch_keys
from scheduler.store.chunk_reading import ChunkFollower, read_chunks
from scheduler.store.hub import Alarms, Hub
from scheduler.store.leases import Leases, ThreadLeases
from scheduler.store.subscriptions import Subscriptions
from workers.publisher import ChunkPublisher

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


def test_a_job_sent_to_placement_leaves_its_sender_subscribed_to_nothing(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    # Celery subscribes a task's sender to its result channel unless told no result is
    # wanted; nobody read that subscription, so a gateway kept one per job it ever sent
    url = redis_server.url.rsplit("/", 1)[0] + "/1"
    with Client(url) as client:
        for n in range(3):
            client.place(JobRequest(model="tiny", prompt=f"job {n}"))
        assert db.llen(keys.placement_queue()) == 3  # sent...
        assert db.pubsub_channels("celery-task-meta-*") == []  # ...and nothing to hear
        consumer = client.app.backend.result_consumer
        assert consumer._pubsub is None or not consumer._pubsub.channels


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


def pubsub_connections(client: redis.Redis) -> int:
    return sum(
        1 for c in client.client_list() if c.get("name") == NAME and "P" in c.get("flags", "")
    )


def test_async_readers_at_once_share_one_connection_and_get_only_their_chunks(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    """50 readers waiting at once, two of them on the same job, one joining after the
    channel was confirmed: one pub/sub connection, and each gets exactly its job's text."""

    async def main() -> tuple[dict[str, list[str]], int, int]:
        client = redis.asyncio.Redis(port=redis_server.port, db=1, client_name=NAME)
        hub = Hub(client)
        try:

            async def texts(job_id: str) -> list[str]:
                chunks = ChunkFollower(client, job_id, 20, subscriptions=hub)
                return [c["response"] async for c in chunks]

            ids = [f"hub-{n}" for n in range(49)] + ["hub-0"]
            readers = [asyncio.create_task(texts(job_id)) for job_id in ids]
            channels = [keys.job_channel(f"hub-{n}") for n in range(49)]
            while not all(count for _, count in db.pubsub_numsub(*channels)):
                await asyncio.sleep(0.01)
            waiting = pubsub_connections(db)
            late = asyncio.create_task(texts("hub-1"))  # after hub-1's confirmation
            await asyncio.sleep(0.1)
            for n in range(49):
                finished_job(db, f"hub-{n}", [f"w{n}", "x"])
            got = await asyncio.gather(*readers, late)
            return dict(zip([*ids, "late"], got, strict=True)), waiting, hub.channels
        finally:
            await hub.aclose()
            await client.aclose()

    got, waiting, left = asyncio.run(main())
    assert waiting == 1  # 50 readers, one connection
    assert got == {**{f"hub-{n}": [f"w{n}", "x", ""] for n in range(49)}, "late": ["w1", "x", ""]}
    assert left == 0  # every channel let go


def test_the_shared_connection_is_made_again_after_a_restart_of_redis(tmp_path: Path) -> None:
    """Its readers get a new confirmation (they backfill from the record: what was
    published meanwhile is not lost to them), then the messages published after."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()

    async def main() -> list[tuple[str, bytes]]:
        client = redis.asyncio.Redis.from_url(server.url, socket_timeout=5)
        hub = Hub(client)
        sync = redis.Redis.from_url(server.url)
        try:
            subs = [await hub.open(f"chan-{n}") for n in range(3)]
            for sub in subs:
                confirmed = await sub.get_message(timeout=5)
                assert confirmed is not None and confirmed["type"] == "subscribe"
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)
            got: list[tuple[str, bytes]] = []
            for n, sub in enumerate(subs):
                again = await sub.get_message(timeout=10)  # subscribed again
                while not sync.pubsub_numsub(f"chan-{n}")[0][1]:
                    await asyncio.sleep(0.01)
                sync.publish(f"chan-{n}", f"after-{n}")
                after = await sub.get_message(timeout=5)
                assert again is not None and after is not None
                got.append((again["type"], after["data"]))
                await sub.aclose()
            return got
        finally:
            await hub.aclose()
            await client.aclose()
            sync.close()

    try:
        got = asyncio.run(main())
    finally:
        server.stop()
    assert got == [("subscribe", f"after-{n}".encode()) for n in range(3)]


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


def test_reader_leases_are_renewed_together_and_let_go(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    """Three streaming readers' leases (2 s each) outlive their lease through one
    renewal task; one let go of is removed; one whose consumer stopped taking its chunks
    lapses; one whose reader gave up before its job ended is left to lapse. A lapsed lease
    reads as cancelled."""

    async def main() -> None:
        client = redis.asyncio.Redis(port=redis_server.port, db=1)
        leases = Leases(client)
        held = [ReaderLease(f"lease-{n}", ttl_s=60, lease_s=2) for n in range(3)]
        try:
            for lease in held:
                leases.hold(lease)
            await asyncio.sleep(4.0)  # twice a lease's life
            for lease in held:
                assert not cancelled_by(*db.mget(watch_keys(lease.job_id)))
            leases.let_go(held[0])
            for _ in range(50):  # removed by the renewing task, within a second
                if not db.exists(keys.job_reader_wanted("lease-0")):
                    break
                await asyncio.sleep(0.1)
            assert not db.exists(keys.job_reader_wanted("lease-0"))  # no longer to end with it
            held[2].handed_at = time.monotonic() - 60  # its consumer stopped reading
            await asyncio.sleep(3.0)
            assert cancelled_by(*db.mget(watch_keys("lease-2")))  # not renewed: lapsed
            assert not cancelled_by(*db.mget(watch_keys("lease-1")))
            leases.let_go(held[1], keep=True)  # a reader that gave up: left to lapse
            leases.cancel("lost-reader", 60)  # its reader lost Redis: cancelled once back
            for _ in range(50):
                if db.exists(keys.cancel_flag("lost-reader")):
                    break
                await asyncio.sleep(0.1)
            assert db.exists(keys.cancel_flag("lost-reader"))
        finally:
            await leases.aclose()
            await client.aclose()

    asyncio.run(main())
    assert soon(lambda: cancelled_by(*db.mget(watch_keys("lease-1"))), within_s=5)
    assert cancelled_by(*db.mget(watch_keys("lease-2")))
    assert not cancelled_by(*db.mget(watch_keys("lease-0")))


def test_a_sync_readers_lease_is_renewed_apart_from_its_consumers_pace(
    redis_server: EmbeddedRedis, db: redis.Redis
) -> None:
    """The Python client's streams: a consumer that takes longer than its lease (2 s)
    between two chunks keeps its job, renewed by the client's one thread; one whose
    consumer took no chunk for READER_STUCK_S lapses, as does one whose reader gave up
    without a word; one let go of is removed at once; the thread stops once it holds
    none."""
    leases = ThreadLeases(redis.Redis(port=redis_server.port, db=1))
    slow, stuck, gave_up = (ReaderLease(f"sync-{n}", ttl_s=60, lease_s=2) for n in range(3))
    for lease in (slow, stuck, gave_up):
        leases.hold(lease)
    readers = [keys.job_reader(f"sync-{n}") for n in range(3)]
    assert soon(lambda: db.exists(*readers) == 3)
    slow.handed_at = time.monotonic()  # its consumer has had a chunk since, taking its time
    stuck.handed_at = time.monotonic() - READER_STUCK_S  # stopped reading long ago
    leases.let_go(gave_up, keep=True)  # gave up, its cancel lost with Redis: left to lapse
    time.sleep(4.0)  # twice the lease's life
    assert not cancelled_by(*db.mget(watch_keys("sync-0")))
    assert cancelled_by(*db.mget(watch_keys("sync-1")))  # not renewed: lapsed
    assert cancelled_by(*db.mget(watch_keys("sync-2")))
    leases.let_go(slow)
    leases.let_go(stuck)
    assert not db.exists(keys.job_reader_wanted("sync-0"))  # at once: a process may end
    assert soon(lambda: leases._thread is None, within_s=5)
    leases.close()


def test_one_timer_ends_many_waits_each_in_its_time() -> None:
    """The hub's alarms: waits end at their own times, in order, from one timer; a wait
    that ended otherwise is forgotten at once."""

    async def main() -> tuple[list[int], int, int]:
        alarms, loop = Alarms(), asyncio.get_running_loop()
        ended: list[int] = []
        waiters = [loop.create_future() for _ in range(3)]
        for n, waiter in enumerate(waiters):
            waiter.add_done_callback(lambda _f, n=n: ended.append(n))
        for timeout, waiter in zip((0.3, 0.1, 0.2), waiters, strict=True):
            alarms.add(timeout, waiter)
        other = loop.create_future()
        gone = alarms.add(0.15, other)
        other.set_result(None)  # a message came first
        alarms.remove(gone, other)
        held = sum(len(s) for s in alarms._due.values())
        await asyncio.gather(*waiters)
        return ended, held, len(alarms._due)

    ended, held, left = asyncio.run(main())
    assert ended == [1, 2, 0]  # 0.1 s, 0.2 s, 0.3 s
    assert held == 3 and left == 0  # nothing due is left once all ended


def test_a_follower_rides_out_redis_restarting_and_gives_up_past_its_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower on a connection of its own: Redis restarted under it, it follows again
    after the last chunk it saw once Redis answers (none lost, none twice); Redis away
    past its budget, it raises Redis's error and lets go of its subscription."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()

    async def main() -> tuple[list[str], ChunkFollower]:
        client = redis.asyncio.Redis.from_url(  # no retry of its own: the follower's
            server.url, socket_timeout=5, retry=AsyncRetry(NoBackoff(), 0)
        )
        sync = redis.Redis.from_url(server.url)
        try:
            pub = ChunkPublisher(sync, "ride", ttl_s=60)
            pub.publish({"response": "a"})
            follower = ChunkFollower(client, "ride", 30, ride_out_s=30)
            texts = [(await follower.__anext__())["response"]]
            await asyncio.to_thread(server.stop)
            reading = asyncio.ensure_future(follower.__anext__())
            await asyncio.to_thread(server.start)
            pub.publish({"response": "b"})
            pub.publish({"response": "", "done": True})
            texts.append((await reading)["response"])
            texts += [chunk["response"] async for chunk in follower]
            ChunkPublisher(sync, "away", ttl_s=60).publish({"response": "x"})  # and no more
            gives_up = ChunkFollower(client, "away", 30, ride_out_s=0.3)
            assert (await gives_up.__anext__())["seq"] == 1
            await asyncio.to_thread(server.stop)
            with pytest.raises(redis.ConnectionError):
                await gives_up.__anext__()
            return texts, gives_up
        finally:
            await client.aclose()
            sync.close()

    try:
        texts, gave_up = asyncio.run(main())
    finally:
        server.stop()
    assert texts == ["a", "b", ""]
    assert "reading on once it answers" in caplog.text  # it rode the restart out
    assert gave_up.sub is None

"""The shared subscriber: one pub/sub connection per client process for every job reader,
on a real Redis, through a dropped connection and a restart of Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from scheduler.local.embedded import EmbeddedRedis
from scheduler.store import keys
from scheduler.store.streams import read_chunks
from scheduler.store.subscriber import Inbox, Subscriber
from workers.chunks import ChunkPublisher


def numsub(client: redis.Redis, job_id: str) -> int:
    return int(client.pubsub_numsub(keys.job_channel(job_id))[0][1])


def pubsub_connections(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if int(c.get("sub", 0)) > 0)


def soon(check: Callable[[], bool], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def read_in_thread(
    client: redis.Redis, job_id: str, hub: Subscriber, into: list[str]
) -> threading.Thread:
    def read() -> None:
        into.extend(c["response"] for c in read_chunks(client, job_id, 20, subscriber=hub))

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_readers_of_many_jobs_share_one_connection(db: redis.Redis) -> None:
    hub = Subscriber(db)
    try:
        got: dict[str, list[str]] = {"a": [], "a2": [], "b": []}
        readers = [
            read_in_thread(db, "job-a", hub, got["a"]),
            read_in_thread(db, "job-a", hub, got["a2"]),  # two readers of one job
            read_in_thread(db, "job-b", hub, got["b"]),
        ]
        assert soon(lambda: numsub(db, "job-a") == 1 and numsub(db, "job-b") == 1)
        assert pubsub_connections(db) == 1
        for job_id in ("job-a", "job-b"):
            pub = ChunkPublisher(db, job_id, ttl_s=60)
            for word in ("x", "y"):
                pub.publish({"response": f"{job_id}:{word}"})
            pub.publish({"response": "", "done": True})
        for thread in readers:
            thread.join(timeout=20)
        assert got == {
            "a": ["job-a:x", "job-a:y", ""],
            "a2": ["job-a:x", "job-a:y", ""],
            "b": ["job-b:x", "job-b:y", ""],
        }
        # readers that ended let go of their channels; the connection stays for the next
        assert numsub(db, "job-a") == 0 and numsub(db, "job-b") == 0
        assert pubsub_connections(db) == 1
    finally:
        hub.close()
    assert soon(lambda: pubsub_connections(db) == 0)


def test_a_killed_connection_is_subscribed_again_and_readers_miss_nothing(
    db: redis.Redis,
) -> None:
    hub = Subscriber(db)
    try:
        pub = ChunkPublisher(db, "job-k", ttl_s=60)
        pub.publish({"response": "one"})
        got: list[str] = []
        reader = read_in_thread(db, "job-k", hub, got)
        assert soon(lambda: got == ["one"])
        db.client_kill_filter(_type="pubsub")
        pub.publish({"response": "two"})  # may be lost with the connection: the record has it
        assert soon(lambda: numsub(db, "job-k") == 1)  # subscribed again on its own
        pub.publish({"response": "", "done": True})
        reader.join(timeout=20)
        assert got == ["one", "two", ""]
    finally:
        hub.close()


def test_a_restart_of_redis_leaves_the_subscriber_serving(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    hub = Subscriber(client)
    try:
        inbox = hub.open(keys.job_channel("job-r"))
        assert kinds(inbox) == ["subscribe"]
        server.stop()
        time.sleep(1.5)  # the reading thread meets the outage
        server.start()
        # subscribed again on its own; the new confirmation tells the reader to backfill
        assert soon(lambda: numsub(client, "job-r") == 1, within_s=20)
        assert soon(lambda: kinds(inbox) == ["subscribe"])
        client.publish(keys.job_channel("job-r"), b"after")
        message = inbox.get_message(timeout=10)
        assert message is not None and message["data"] == b"after"
        inbox.close()
        assert soon(lambda: not hub.health.failing(time.monotonic() + 60, 0))
        # and a new reader is served by the same thread
        ChunkPublisher(client, "job-r2", ttl_s=60).publish({"response": "", "done": True})
        assert [c["seq"] for c in read_chunks(client, "job-r2", 10, subscriber=hub)] == [1]
    finally:
        hub.close()
        client.close()
        server.stop()


def kinds(inbox: Inbox) -> list[str]:
    """The kinds of the messages waiting in ``inbox`` (taken out)."""
    found = []
    while (message := inbox.get_message(timeout=0.5)) is not None:
        found.append(message["type"])
    return found

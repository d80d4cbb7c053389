"""Token chunks of a job: published on Redis pub/sub, recorded in a replayable stream.

Every chunk carries ``seq`` (1, 2, ...). The stream's entry ids are ``0-<seq>``, so a reader
that subscribed late, or lost its connection, reads what it missed with one XRANGE and then
follows the channel: nothing is lost and nothing is seen twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import redis

from scheduler import keys

Entries = list[tuple[bytes, dict[bytes, bytes]]]


class ChunkPublisher:
    """Publishes the chunks of one job, in order."""

    def __init__(self, client: redis.Redis, job_id: str, ttl_s: int) -> None:
        self.r = client
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.seq = 0

    def publish(self, chunk: dict[str, Any]) -> None:
        self.seq += 1
        payload = json.dumps(dict(chunk, seq=self.seq))
        stream = keys.job_chunks(self.job_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(stream, {"c": payload}, id=f"0-{self.seq}")
        pipe.publish(keys.job_channel(self.job_id), payload)
        if self.seq == 1 or chunk.get("done"):
            pipe.expire(stream, self.ttl_s)
        pipe.execute()


def publish_final(client: redis.Redis, job_id: str, chunk: dict[str, Any], ttl_s: int) -> None:
    """Record the final chunk of a job from a process that published nothing before it."""
    stream = keys.job_chunks(job_id)
    last = cast(list[tuple[bytes, Any]], client.xrevrange(stream, count=1))
    publisher = ChunkPublisher(client, job_id, ttl_s)
    publisher.seq = int(last[0][0].decode().split("-")[1]) if last else 0
    publisher.publish(dict(chunk, done=True))


def read_chunks(
    client: redis.Redis, job_id: str, timeout_s: float | None, after_seq: int = 0
) -> Iterator[dict[str, Any]]:
    """Yield the chunks of a job from ``after_seq + 1`` on, until the final one.

    Raises TimeoutError when no chunk arrives for ``timeout_s`` seconds.
    """
    stream = keys.job_chunks(job_id)
    last = after_seq
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.job_channel(job_id))
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        backfill = True  # subscribed first, so the stream now holds all we could have missed
        while True:
            if backfill:
                entries = cast(Entries, client.xrange(stream, min=f"0-{last + 1}"))
                for _id, fields in entries:
                    chunk = json.loads(fields[b"c"])
                    last = chunk["seq"]
                    yield chunk
                    if chunk.get("done"):
                        return
                backfill = False
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no chunk of job {job_id} for {timeout_s} s")
            message = pubsub.get_message(timeout=wait)
            if message is None:
                backfill = True  # quiet for a while: re-check the record in case we lost one
                continue
            chunk = json.loads(message["data"])
            if chunk["seq"] != last + 1:
                backfill = chunk["seq"] > last + 1
                continue
            last = chunk["seq"]
            if deadline is not None:
                deadline = time.monotonic() + timeout_s  # type: ignore[operator]
            yield chunk
            if chunk.get("done"):
                return
    finally:
        pubsub.close()

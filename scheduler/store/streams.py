"""Token chunks of a job: published on Redis pub/sub, recorded in a replayable stream.

Every chunk carries ``seq`` (1, 2, ...). The stream's entry ids are ``0-<seq>``, so a reader
that subscribed late, or lost its connection, reads what it missed with one XRANGE and then
follows the channel: nothing is lost and nothing is seen twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from enum import IntEnum
from typing import Any, cast

import redis
import redis.asyncio

from scheduler.custody import JobState
from scheduler.errors import ChunksLost, GgufqError, JobCancelled
from scheduler.midstream import SoFar, for_readers
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY, aride_out
from scheduler.store.hub import Hub
from scheduler.store.scripts import queue, script
from scheduler.store.subscriptions import Subscriptions

Entries = list[tuple[bytes, dict[bytes, bytes]]]
log = logging.getLogger(__name__)


class Appended(IntEnum):
    """What lua/append.lua did with a chunk (its header cites these values)."""

    WRITTEN = 1
    FENCED = 0  # not written: the job's custody record names another holder now
    DUPLICATE = -1  # not written again: the stream has this seq already


def outcome_of(chunk: dict[str, Any] | None) -> str:
    """The state a job ends in with ``chunk``, as the scripts that write it take it (its
    custody record moves there when the chunk is written); "" for a chunk that is not
    final."""
    if not chunk or not chunk.get("done"):
        return ""
    if chunk.get("done_reason") == "cancel":
        return JobState.CANCELLED.value
    return (JobState.FAILED if chunk.get("error") else JobState.DONE).value


def _append_call(
    job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str
) -> tuple[list[str], list[Any]]:
    """lua/append.lua's keys and arguments for one chunk: written only while the job's
    custody record's holder is ``fence`` (a placement id; "" always writes)."""
    keys_, args = chunk_call(job_id, seq, chunk, ttl_s, fence)
    return [*keys_, keys.job_custody(job_id)], [*args, outcome_of(chunk)]


def chunk_call(
    job_id: str, seq: int, chunk: dict[str, Any] | None, ttl_s: int, fence: str
) -> tuple[list[str], list[Any]]:
    """The stream and channel keys and the fence, seq, payload and ttl arguments of a
    script that writes a job's chunk among other things (lua/end.lua); ``chunk`` None
    writes none."""
    payload = "" if chunk is None else json.dumps(dict(chunk, seq=seq))
    job_keys = [keys.job_chunks(job_id), keys.job_channel(job_id)]
    return job_keys, [fence, seq, payload, ttl_s]


def write_chunk(
    client: redis.Redis, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> Appended:
    """Record and publish one chunk (lua/append.lua) in one round trip."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    return Appended(int(_registered(client, "append")(keys=job_keys, args=args, client=client)))


def append_command(
    client: Any, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> tuple[Any, ...]:
    """:func:`write_chunk` as one EVALSHA command's arguments, to send on a connection whose
    answer is read later (workers/first_chunk.py): it is :class:`Appended`, or NOSCRIPT
    when Redis lost the script (then write the chunk the usual way)."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    return ("EVALSHA", _registered(client, "append").sha, len(job_keys), *job_keys, *args)


def queue_chunk(
    pipe: Any, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> None:
    """:func:`write_chunk` queued on a pipeline by the script's hash alone (run the pipeline
    with :func:`scheduler.store.scripts.execute`; append.lua skips a chunk already there)."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    queue(pipe, _registered(pipe, "append"), job_keys, args)


_REGISTERED: dict[str, Any] = {}  # name → the registered script, made on first use


def _registered(client: Any, name: str) -> Any:
    if name not in _REGISTERED:
        _REGISTERED[name] = script(client, name)
    return _REGISTERED[name]


def error_chunk(model: str, job_id: str, exc: GgufqError, **fields: Any) -> dict[str, Any]:
    """The final chunk of a job that failed or was cancelled (the reader raises ``exc``)."""
    reason = "cancel" if isinstance(exc, JobCancelled) else "error"
    return dict(
        fields,
        model=model,
        job_id=job_id,
        created_at=time.time(),
        response="",
        done=True,
        done_reason=reason,
        error={"code": exc.code, "message": str(exc)},
    )


def progress(client: redis.Redis, job_id: str) -> tuple[int, bool]:
    """(chunks recorded so far, whether the final one is among them)."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.job_chunks(job_id))
    pipe.xrevrange(keys.job_chunks(job_id), count=1)
    count, last = pipe.execute()
    return int(count), final_seq(last) is not None


def so_far(client: redis.Redis, job_id: str) -> SoFar:
    """What a job's stream holds of its answer (a resumed run goes on from there)."""
    entries = cast(Entries, client.xrange(keys.job_chunks(job_id)))
    return SoFar.of([json.loads(fields[b"c"]) for _id, fields in entries])


def final_seq(last: Entries) -> int | None:
    """The seq of the stream's final chunk, when its last entry (XREVRANGE COUNT 1) is one."""
    if not last:
        return None
    entry, fields = last[0]
    return int(entry.split(b"-")[1]) if json.loads(fields[b"c"]).get("done") else None


def publish_final(client: redis.Redis, job_id: str, chunk: dict[str, Any], ttl_s: int) -> None:
    """End a job from a process that published nothing before it (placement fails or
    cancels it): its final chunk after whatever its stream holds, and out of the parked
    queue if it waits there, in one step (lua/final.lua)."""
    final = dict(chunk, done=True)
    args = [job_id, json.dumps(final), ttl_s, outcome_of(final)]
    _registered(client, "final")(keys=[], args=args, client=client)


QUIET_MAX_S = 8.0  # the longest quiet spell, by default, before a reader looks at the record


class ChunkOrder:
    """What a reader of a job's chunks does next, without I/O (both readers below use it).

    Once the subscription is confirmed, chunks come first from the job's stream record
    (XRANGE, a backfill), then from pub/sub. A chunk out of order, or a quiet spell, means
    one may have been lost: backfill again.
    The quiet spell doubles from 1 s up to ``QUIET_MAX_S`` while nothing comes (a job waiting
    for a slot would otherwise wake its reader and Redis every second) and is 1 s again
    after each chunk.
    """

    __slots__ = (
        "job_id",
        "timeout_s",
        "quiet_max_s",
        "clock",
        "last",
        "backfill",
        "quiet",
        "done",
        "quiet_s",
        "deadline",
    )  # a gateway holds one a waiting reader: no dict each

    def __init__(
        self,
        job_id: str,
        timeout_s: float | None,
        after_seq: int = 0,
        clock: Callable[[], float] = time.monotonic,
        quiet_max_s: float = QUIET_MAX_S,
    ) -> None:
        self.job_id, self.timeout_s = job_id, timeout_s
        self.quiet_max_s = quiet_max_s
        self.clock = clock
        self.last = after_seq
        # the first backfill follows the subscription's confirmation: from then on the
        # record holds all that the channel could have missed
        self.backfill = False
        self.quiet = False  # the backfill due is after a quiet spell
        self.done = False
        self.quiet_s = 1.0
        self.deadline = None if timeout_s is None else self.clock() + timeout_s

    def again(self) -> ChunkOrder:
        """The order of a new subscription, after the last chunk this one saw."""
        return ChunkOrder(self.job_id, self.timeout_s, self.last, self.clock, self.quiet_max_s)

    @property
    def backfill_from(self) -> str:
        return f"0-{self.last + 1}"

    def from_record(self, entries: Entries) -> list[dict[str, Any]]:
        """The backfilled chunks to yield, up to the final one."""
        self.quiet = False
        chunks = []
        for _id, fields in entries:
            chunk = for_readers(json.loads(fields[b"c"]))
            if chunk["seq"] != self.last + 1:  # the record lost them too: say so
                raise ChunksLost(
                    f"chunks {self.last + 1} to {chunk['seq'] - 1} of job {self.job_id} are "
                    "lost (Redis lost them, or its record expired); the text so far has a "
                    "hole: submit the job again"
                )
            self.last = chunk["seq"]
            chunks.append(chunk)
            if chunk.get("done"):
                self.done = True
                break
        self.backfill = False
        return chunks

    def wait_s(self) -> float:
        """How long to wait for the next message; TimeoutError when the time is up."""
        if self.deadline is None:
            return self.quiet_s
        wait = min(self.quiet_s, self.deadline - self.clock())
        if wait <= 0:
            raise TimeoutError(f"no chunk of job {self.job_id} for {self.timeout_s} s")
        return wait

    def from_message(self, message: dict[str, Any] | None) -> dict[str, Any] | None:
        """The chunk to yield, if the message carries the next one."""
        if message is None:
            self.backfill = self.quiet = True  # quiet: re-check the record for a lost one
            self.quiet_s = min(self.quiet_s * 2, self.quiet_max_s)
            return None
        kind = message.get("type", "message")
        if kind == "subscribe":  # subscribed (again, after a reconnection): read the record
            self.backfill = True
            return None
        if kind != "message":
            return None
        self.quiet_s = 1.0
        try:
            chunk: dict[str, Any] = json.loads(message["data"])
            seq = int(chunk["seq"])
        except (ValueError, TypeError, KeyError):  # not a chunk: the record decides
            log.warning("ignored a message on job %s's channel that is not a chunk", self.job_id)
            self.backfill = True
            return None
        if seq != self.last + 1:
            self.backfill = seq > self.last + 1
            return None
        self.last = seq
        if self.timeout_s is not None:
            self.deadline = self.clock() + self.timeout_s
        self.done = bool(chunk.get("done"))
        return for_readers(chunk)


def read_chunks(
    client: redis.Redis,
    job_id: str,
    timeout_s: float | None,
    after_seq: int = 0,
    on_quiet: Callable[[], None] | None = None,
    subscriptions: Subscriptions | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the chunks of a job from ``after_seq + 1`` on, until the final one (a
    reader's lease is renewed apart: scheduler/store/leases.py).

    Raises TimeoutError when no chunk arrives for ``timeout_s`` seconds. ``on_quiet`` is
    called after each quiet spell (the job's handle checks that it is not lost there).
    The channel is followed through a connection taken from ``subscriptions`` (and given
    back) when given, else through a connection of its own.
    """
    order = ChunkOrder(job_id, timeout_s, after_seq)
    pubsub: Any
    if subscriptions is not None:
        pubsub = subscriptions.open(keys.job_channel(job_id))
    else:
        pubsub = client.pubsub()
        pubsub.subscribe(keys.job_channel(job_id))
    try:
        while not order.done:
            if order.backfill:
                if order.quiet and on_quiet is not None:
                    on_quiet()
                entries = client.xrange(keys.job_chunks(job_id), min=order.backfill_from)
                yield from order.from_record(cast(Entries, entries))
                continue
            chunk = order.from_message(pubsub.get_message(timeout=order.wait_s()))
            if chunk is not None:
                yield chunk
    finally:
        pubsub.close()


class ChunkFollower:
    """:func:`read_chunks` on redis.asyncio, as an async iterator: subscribe, backfill with
    XRANGE, then follow. ``quiet_max_s``: the longest quiet spell before a look at the
    record (a reader of the shared connection, which loses a message only with the
    connection, looks seldom).

    Raises TimeoutError when no chunk arrives for ``timeout_s`` seconds. With a
    ``ride_out_s``, Redis going away is ridden out: it follows again from the last chunk
    seen once Redis answers within that many seconds. It lets go of its subscription when
    it ends or raises, or when closed (:meth:`aclose`). Not an async
    generator: a gateway holds one for each waiting client, and one coroutine waiting here
    costs less than a generator's object, its ``asend`` and the event loop's weak
    reference to it.
    """

    __slots__ = ("client", "job_id", "order", "on_quiet", "hub", "ride_out_s", "sub", "ready")

    def __init__(
        self,
        client: redis.asyncio.Redis,
        job_id: str,
        timeout_s: float | None,
        after_seq: int = 0,
        on_quiet: Callable[[], Awaitable[object]] | None = None,
        subscriptions: Hub | None = None,
        quiet_max_s: float = QUIET_MAX_S,
        ride_out_s: float = 0.0,
    ) -> None:
        self.client, self.job_id, self.on_quiet, self.hub = client, job_id, on_quiet, subscriptions
        self.ride_out_s = ride_out_s
        self.order = ChunkOrder(job_id, timeout_s, after_seq, quiet_max_s=quiet_max_s)
        self.sub: Any = None  # a Hub's Subscription, or a PubSub of its own
        self.ready: list[dict[str, Any]] = []  # backfilled chunks not handed out yet

    def __aiter__(self) -> ChunkFollower:
        return self

    async def __anext__(self) -> dict[str, Any]:
        order = self.order
        try:
            while not self.ready:
                if order.done:
                    raise StopAsyncIteration
                try:
                    if self.sub is None:
                        self.sub = await self._subscribe()
                    if order.backfill:
                        if order.quiet and self.on_quiet is not None:
                            await self.on_quiet()
                        key = keys.job_chunks(self.job_id)
                        entries = await self.client.xrange(key, min=order.backfill_from)
                        self.ready = order.from_record(cast(Entries, entries))
                        continue
                    message = await self.sub.get_message(timeout=order.wait_s())
                except REDIS_AWAY as exc:
                    if self.ride_out_s <= 0:
                        raise
                    order = await self._ride_out(exc)
                    continue
                chunk = order.from_message(message)
                if chunk is not None:
                    self.ready.append(chunk)
            chunk = self.ready.pop(0)
            if order.done and not self.ready:  # its last: nothing more to hear
                await self.aclose()
            return chunk
        except BaseException:
            await self.aclose()
            raise

    async def _ride_out(self, exc: Exception) -> ChunkOrder:
        """Wait for Redis to answer again (raise ``exc`` past ``ride_out_s``); the order
        of the next subscription, after the last chunk seen."""
        await self.aclose()
        log.warning("job %s's stream lost Redis (%s): reading on once it answers", self.job_id, exc)
        await aride_out(self.client.ping, self.ride_out_s, exc)
        self.order = self.order.again()
        return self.order

    async def _subscribe(self) -> Any:
        channel = keys.job_channel(self.job_id)
        if self.hub is not None:
            return await self.hub.open(channel)
        pubsub = self.client.pubsub()
        await pubsub.subscribe(channel)
        return pubsub

    async def aclose(self) -> None:
        """Let go of the subscription (done already once it ended or raised)."""
        sub, self.sub = self.sub, None
        if sub is not None:
            await sub.aclose()

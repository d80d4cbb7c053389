"""Reading a job's chunks: from its stream record (a backfill with XRANGE), then from its
pub/sub channel, in order, with nothing lost and nothing seen twice (what is written, and
how: :mod:`scheduler.store.streams`)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, cast

import redis
import redis.asyncio

from scheduler.errors import ChunksLost
from scheduler.midstream import for_readers
from scheduler.redis_urls import address, split_urls
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY, aride_out, connect_typed, connect_typed_async
from scheduler.store.hub import Hub
from scheduler.store.shards import Shards, stream_shards
from scheduler.store.streams import Entries
from scheduler.store.subscriptions import Subscriptions

log = logging.getLogger(__name__)

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


class ChunkSources:
    """Where a client reads each job's chunks: the Redis its stream lives on
    (scheduler/store/shards.py) and a pool of subscriptions there; connected, and the
    instances checked against placement's, at the first read (a client that reads no
    stream, `ggufq ps`, needs no GGUFQ_STREAM_REDIS_URLS)."""

    def __init__(self, control: redis.Redis, urls: str, max_connections: int | None = None):
        self.control, self.urls, self.max_connections = control, urls, max_connections
        self._built: tuple[Shards[redis.Redis], Shards[Subscriptions]] | None = None
        self._lock = threading.Lock()

    def check(self) -> Shards[redis.Redis]:
        """The stream instances' clients (BadSettings when placement serves others)."""
        with self._lock:
            if self._built is None:
                connect = partial(connect_typed, max_connections=self.max_connections)
                clients = stream_shards(self.control, self.urls, connect)
                self._built = (clients, clients.map(Subscriptions))
            return self._built[0]

    def by_address(self) -> dict[str, redis.Redis]:
        """The stream instances apart from the control Redis, by address (none where the
        streams live beside the control state)."""
        found: dict[str, redis.Redis] = {}
        urls, clients = split_urls(self.urls), self.check().others
        for n, (url, client) in enumerate(zip(urls, clients, strict=True), 1):
            name = address(url)  # two alike (one Sentinel master name) told apart by place
            found[name if name not in found else f"{name} (#{n} in the list)"] = client
        return found

    def of(self, job_id: str) -> tuple[redis.Redis, Subscriptions]:
        self.check()
        assert self._built is not None
        clients, subscriptions = self._built
        return clients.of(job_id), subscriptions.of(job_id)

    def close(self) -> None:
        if self._built is None:
            return
        clients, subscriptions = self._built
        for each in subscriptions.all:
            each.close()
        for client in clients.others:
            client.close()


class AsyncChunkSources:
    """:class:`ChunkSources` on redis.asyncio: the Redis of each job's stream, and a hub
    there (on a connection of its own, with replies bounded by ``side_timeout_s``)."""

    def __init__(
        self,
        control: redis.asyncio.Redis,
        hub: Hub,
        urls: str,
        side_timeout_s: float,
        max_connections: int | None = None,
    ) -> None:
        found = split_urls(urls)
        self.clients = Shards(control, [connect_typed_async(u, max_connections) for u in found])
        sides = [connect_typed_async(url, socket_timeout=side_timeout_s) for url in found]
        self.hubs = Shards(hub, [Hub(side) for side in sides])
        self._sides = sides

    def of(self, job_id: str) -> tuple[redis.asyncio.Redis, Hub]:
        return self.clients.of(job_id), self.hubs.of(job_id)

    async def aclose(self) -> None:
        for hub in self.hubs.others:
            await hub.aclose()
        for client in [*self._sides, *self.clients.others]:
            await client.aclose()

"""One pub/sub connection for every reader of an asyncio process (the gateway's waiting
requests, however many): readers subscribe through it, one task reads it and hands each
message to the readers of its channel.

A connection per waiting request made Redis connections grow with the clients (2,000
streaming requests drove one gateway past redis-py's pool limit, and 10,000 across gateways
would pass Redis's ``maxclients``). Here they stay one per process. A reader's
:class:`Subscription` reads like a redis-py ``PubSub`` (``get_message(timeout)``,
``aclose()``), so the stream reader follows it as it followed a connection of its own: its
first message is its channel's ``subscribe`` confirmation (then the reader backfills from
the stream's record), and after the connection was lost and made again each reader gets a
confirmation again, so it backfills what it may have missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
from typing import Any

import redis
import redis.asyncio

from scheduler.loops import stop_task

log = logging.getLogger(__name__)
Message = dict[str, Any]
RETRY_S = (0.1, 0.25, 0.5, 1.0)  # waits between attempts to subscribe again after a loss
# a reader here loses a message only with the connection, and is told when it is made
# again: it looks at its job's record after quiet spells of up to this (8 s elsewhere)
QUIET_S = 30.0


class Subscription:
    """One reader's subscription to one channel of the :class:`Hub`: its messages in a list,
    and the future its reader waits on (an asyncio.Queue would cost three deques a reader,
    and a gateway holds thousands of readers)."""

    __slots__ = ("hub", "channel", "_messages", "_waiter")

    def __init__(self, hub: Hub, channel: bytes) -> None:
        self.hub, self.channel = hub, channel
        self._messages: list[Message] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, message: Message) -> None:
        self._messages.append(message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_message(self, timeout: float | None) -> Message | None:
        """The next message of the channel, or None once ``timeout`` has passed (a timer
        that ends the wait, not asyncio.wait_for's coroutine, future and task-like
        machinery for each of thousands of waiting readers)."""
        if not self._messages:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            alarms = self.hub.alarms
            tick = None
            if timeout is not None and math.isfinite(timeout):
                tick = alarms.add(timeout, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if tick is not None:
                    alarms.remove(tick, waiter)
        return self._messages.pop(0) if self._messages else None

    async def aclose(self) -> None:
        await self.hub.leave(self)


class Alarms:
    """Ends waits whose time is up, with one timer for all of them: a timer a wait (a
    libuv timer under uvloop, about 500 bytes) costs thousands of waiting readers more
    than their subscriptions. Waits due in the same ``TICK_S`` share a set; a wait is
    ended at most ``TICK_S`` late."""

    TICK_S = 0.05
    __slots__ = ("_due", "_ticks", "_timer", "_armed", "_loop")

    def __init__(self) -> None:
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._due: dict[int, set[asyncio.Future[None]]] = {}
        self._ticks: list[int] = []  # a heap of the ticks in _due (and of emptied ones)
        self._timer: asyncio.TimerHandle | None = None
        self._armed: int | None = None  # the tick the timer rings at
        self._loop = loop  # the loop the timer and the waits are on

    def add(self, timeout: float, waiter: asyncio.Future[None]) -> int:
        """End ``waiter`` (set_result None) ``timeout`` seconds from now; its tick."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # another loop (the last one closed): start afresh
            self._reset(loop)
        tick = math.ceil((loop.time() + timeout) / self.TICK_S)
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = set()
            heapq.heappush(self._ticks, tick)
        due.add(waiter)
        if self._armed is None or tick < self._armed:
            self._arm(loop, self._ticks[0])  # the earliest due, this one or before it
        return tick

    def remove(self, tick: int, waiter: asyncio.Future[None]) -> None:
        """Forget a wait that ended otherwise (its tick from :meth:`add`)."""
        due = self._due.get(tick)
        if due is not None:
            due.discard(waiter)
            if not due:
                del self._due[tick]  # its tick leaves the heap when it comes up

    def _arm(self, loop: asyncio.AbstractEventLoop, tick: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = tick
        self._timer = loop.call_at(tick * self.TICK_S, self._ring, loop)

    def _ring(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = self._armed = None
        now = (loop.time() + 0.001) / self.TICK_S  # a timer may ring a little early
        ticks = self._ticks
        while ticks and (ticks[0] <= now or ticks[0] not in self._due):
            for waiter in self._due.pop(heapq.heappop(ticks), ()):
                if not waiter.done():
                    waiter.set_result(None)
        if ticks:
            self._arm(loop, ticks[0])


class Hub:
    """The shared pub/sub connection of one redis.asyncio client (used from its loop)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        # a list, not a set: a channel mostly has one reader, and a gateway thousands
        self._readers: dict[bytes, list[Subscription]] = {}
        self._confirmed: set[bytes] = set()  # channels Redis confirmed on this connection
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._stale = False  # the connection was made again: subscribe every channel on it
        # commands on the connection one at a time: redis-py's PubSub takes a connection
        # from its pool on its first command, and commands sent at once would each take one
        self._sending = asyncio.Lock()
        self.alarms = Alarms()  # the readers' waits' timeouts

    @property
    def channels(self) -> int:
        return len(self._readers)

    async def open(self, channel: str) -> Subscription:
        """A subscription to ``channel``: its confirmation comes as its first message.
        Raises redis.RedisError when Redis is away."""
        name = channel.encode()
        sub = Subscription(self, name)
        readers = self._readers.setdefault(name, [])
        readers.append(sub)
        if name in self._confirmed:
            sub.put(_confirmation(name))
        elif len(readers) == 1:
            try:
                async with self._sending:
                    await self._connected().subscribe(name)
            except BaseException:
                readers.remove(sub)
                if readers:  # others joined it meanwhile: subscribed by the next look
                    self._stale = True
                    self._start()
                else:
                    del self._readers[name]
                raise
        self._start()
        return sub

    async def leave(self, sub: Subscription) -> None:
        readers = self._readers.get(sub.channel)
        if readers is None or sub not in readers:
            return
        readers.remove(sub)
        if readers:
            return
        del self._readers[sub.channel]
        self._confirmed.discard(sub.channel)
        try:
            async with self._sending:
                if self._pubsub is not None:
                    await self._pubsub.unsubscribe(sub.channel)
        except Exception:  # a new connection, without the channel left
            await self._drop()
            self._start()

    async def aclose(self) -> None:
        self._closed = True
        await stop_task(self._task)
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()

    # -- the connection and its one reading task --------------------------------------------
    def _connected(self) -> Any:
        if self._pubsub is None:
            self._pubsub = self.client.pubsub()
        return self._pubsub

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._read(), name="ggufq-pubsub-hub")

    async def _read(self) -> None:
        failures = 0
        while not self._closed:
            try:
                if self._stale:  # the connection was made again: every reader's channel
                    await self._resubscribe()
                pubsub = self._pubsub
                if pubsub is None or not pubsub.subscribed:
                    if not self._readers:
                        return  # nothing to read: started again by the next open
                    self._stale = True
                    continue
                message = await pubsub.get_message(timeout=1.0)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection was lost (Redis restarted or away)
                wait = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.warning("pub/sub connection lost (%s): subscribing again in %s s", exc, wait)
                await self._drop()
                await asyncio.sleep(wait)
                continue
            if message is not None:
                self._deliver(message)

    def _deliver(self, message: Message) -> None:
        channel = message.get("channel")
        if isinstance(channel, str):
            channel = channel.encode()
        kind = message.get("type")
        if kind == "subscribe" and channel in self._readers:
            self._confirmed.add(channel)
        elif kind not in ("message", "subscribe"):
            return
        for sub in self._readers.get(channel, ()):  # type: ignore[arg-type]
            sub.put(message)

    async def _drop(self) -> None:
        """Let the lost connection go; the next look subscribes every reader's channel on
        a new one (a reader that opens meanwhile subscribes its own there first)."""
        async with self._sending:
            old, self._pubsub = self._pubsub, None
            self._confirmed.clear()
            self._stale = True
        if old is not None:
            with contextlib.suppress(Exception):
                await old.aclose()

    async def _resubscribe(self) -> None:
        """Every channel with readers, on the current connection (again, for those a reader
        subscribed since: harmless); each reader gets the new confirmation, and so
        backfills what it may have missed."""
        async with self._sending:
            channels = list(self._readers)
            if channels:
                await self._connected().subscribe(*channels)
            self._stale = False


def _confirmation(channel: bytes) -> Message:
    return {"type": "subscribe", "pattern": None, "channel": channel, "data": 1}

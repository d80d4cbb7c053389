"""Pub/sub connections for the job readers of a thread-based process (the Python client),
kept and used again: no connection is opened and closed per streamed job. (An asyncio
process shares one connection among all its readers: :mod:`scheduler.store.hub`.)

A reader takes a :class:`Subscription` on its job's channel: an idle connection of the
process when there is one, else a new one. It reads like a redis-py ``PubSub``
(``get_message(timeout)``, ``close()``), so :mod:`streams` follows it as it followed a
connection of its own. Each connection serves one reader at a time (redis-py's ``PubSub``
is not safe to share between threads), and goes back to the idle ones only once Redis has
confirmed its unsubscription, so no message of one job reaches the next job's reader.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis

Message = dict[str, Any]


EARLY_TRIES = 4  # reads within one wait that may end early before the wait gives up


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _over(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _ours(message: Message | None, channel: bytes) -> bool:
    """Whether ``message`` is for the reader of ``channel`` (a message or its subscription's
    confirmation), not a stray reply or another channel's."""
    if message is None:
        return False
    found = message.get("channel")
    return (found.encode() if isinstance(found, str) else found) == channel


class Subscription:
    """One reader's subscription to one channel."""

    def __init__(self, pool: Subscriptions, pubsub: Any, channel: bytes, kept: bool) -> None:
        self.pool, self.pubsub, self.channel = pool, pubsub, channel
        self.kept = kept  # on a kept connection, not yet seen to work

    def get_message(self, timeout: float | None) -> Message | None:
        """The next message of this channel, or None once ``timeout`` has passed (a reply
        that is nobody's message, such as a late health-check answer, does not end the
        wait early)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(EARLY_TRIES):
            message = self._read(_left(deadline))
            if _ours(message, self.channel) or _over(deadline):
                return message
        return None

    def _read(self, timeout: float | None) -> Message | None:
        try:
            message: Message | None = self.pubsub.get_message(timeout=timeout)
        except redis.ConnectionError:
            if not self.kept:
                raise
            # a kept connection that Redis closed while it was idle (a restart): once,
            # subscribe on a new one; its confirmation makes the reader backfill
            self.kept = False
            self.pubsub.close()
            self.pubsub = self.pool.client.pubsub()
            self.pubsub.subscribe(self.channel)
            return None
        if message is not None:
            self.kept = False
        return message

    def close(self) -> None:
        self.pool.give_back(self)


class _Idle:
    """The idle connections of one client (after a fork, the child's own)."""

    KEEP = 16  # idle connections kept at most; more are closed
    UNSUBSCRIBE_WAIT_S = 2.0  # a connection whose unsubscription is not confirmed is closed

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._closed = False

    def _keeps(self) -> bool:
        return not self._closed and self._pid == os.getpid()

    def _take(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's sockets are not ours
                self._idle, self._pid = [], os.getpid()
            return self._idle.pop() if self._idle else None  # none once closed

    def _keep(self, pubsub: Any) -> bool:
        """Keep ``pubsub`` (unsubscribed) for the next reader; False when it must close."""
        with self._lock:
            if self._keeps() and len(self._idle) < self.KEEP:
                self._idle.append(pubsub)
                return True
        return False

    def _let_go(self) -> list[Any]:
        """Stop keeping: the idle connections, for the caller to close."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        return idle if self._pid == os.getpid() else []


class Subscriptions(_Idle):
    """Kept pub/sub connections of one Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        self.client = client

    def open(self, channel: str) -> Subscription:
        """A subscription to ``channel``: its confirmation comes as its first message.
        Raises redis.RedisError when Redis is away."""
        kept = self._take()
        if kept is not None:
            try:
                kept.subscribe(channel)
                return Subscription(self, kept, channel.encode(), kept=True)
            except redis.RedisError:  # closed while idle: a new one
                kept.close()
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(channel)
        except BaseException:
            pubsub.close()
            raise
        return Subscription(self, pubsub, channel.encode(), kept=False)

    def give_back(self, sub: Subscription) -> None:
        """Unsubscribe, and keep the connection for the next reader once Redis confirms it
        (close it on any doubt: an error, a timeout, more to read than expected)."""
        pubsub = sub.pubsub
        try:
            clean = self._keeps() and _unsubscribed(pubsub, sub.channel, self.UNSUBSCRIBE_WAIT_S)
        except BaseException:  # interrupted (Ctrl-C): no doubt left open
            pubsub.close()
            raise
        if not (clean and self._keep(pubsub)):
            pubsub.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when their readers give them back."""
        for pubsub in self._let_go():
            pubsub.close()


def _unsubscribed(pubsub: Any, channel: bytes, wait_s: float) -> bool:
    """Unsubscribe from ``channel`` and read up to its confirmation (chunks still on the
    way are dropped): True when the connection is then subscribed to nothing."""
    try:
        pubsub.unsubscribe(channel)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            message = pubsub.get_message(timeout=left)
            if message is not None and message.get("type") == "unsubscribe":
                return not pubsub.subscribed
        return False
    except (redis.RedisError, OSError, RuntimeError):
        return False

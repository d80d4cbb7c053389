"""One pub/sub connection per client process for all its readers of job channels.

A reader opens an :class:`Inbox` on its job's channel; one thread reads the shared
connection and puts each message into the inboxes of its channel. An inbox reads like a
redis-py ``PubSub`` (``get_message(timeout)``, ``close()``), so :mod:`streams` follows it
as it followed a connection of its own. The subscription's confirmation reaches the inbox
too, and after a reconnection redis-py subscribes again to every channel, whose new
confirmations tell each reader to backfill what it missed from the job's stream record.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from typing import Any

import redis

from scheduler.loops import LoopHealth, start_loop
from scheduler.store import keys

log = logging.getLogger(__name__)
Message = dict[str, Any]


class Inbox:
    """The messages of one channel for one reader."""

    def __init__(self, hub: Subscriber, channel: bytes) -> None:
        self.hub, self.channel = hub, channel
        self.queue: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def get_message(self, timeout: float | None) -> Message | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.hub.close_inbox(self)


class Subscriber:
    """The shared subscription of one Redis client (and so one process: after a fork the
    child starts its own on first use)."""

    WAIT_S = 1.0  # how often the reading thread looks up from the connection

    def __init__(self, client: redis.Redis, health: LoopHealth | None = None) -> None:
        self.client = client
        self.health = health or LoopHealth()
        self._lock = threading.Lock()
        self._inboxes: dict[bytes, list[Inbox]] = {}
        self._unsubscribe: set[bytes] = set()  # channels whose unsubscribe failed: again
        self._pubsub: Any = None
        self._stop = threading.Event()
        self._pid = 0

    def open(self, channel: str) -> Inbox:
        """An inbox on ``channel``, subscribed (its confirmation comes as its first message);
        raises redis.RedisError when Redis is away."""
        inbox = Inbox(self, channel.encode())
        with self._lock:
            pubsub = self._running()
            self._inboxes.setdefault(inbox.channel, []).append(inbox)
            self._unsubscribe.discard(inbox.channel)
            try:
                pubsub.subscribe(inbox.channel)
            except BaseException:
                self._drop(inbox)
                raise
        return inbox

    def close_inbox(self, inbox: Inbox) -> None:
        with self._lock:
            if self._drop(inbox) and self._pubsub is not None:
                self._unsubscribe.add(inbox.channel)
                self._let_go()

    def close(self) -> None:
        """Stop the reading thread and close the connection (the client is closing)."""
        with self._lock:
            self._stop.set()
            if self._pubsub is not None and self._pid == os.getpid():
                self._pubsub.close()
            self._pubsub = None

    # -- under self._lock ---------------------------------------------------------------
    def _running(self) -> Any:
        if self._pubsub is not None and self._pid == os.getpid():
            return self._pubsub
        # first use, or a forked child: the parent's connection and thread are not ours
        self._stop = threading.Event()
        self._inboxes, self._unsubscribe, self._pid = {}, set(), os.getpid()
        pubsub = self.client.pubsub()
        # a channel of its own keeps the connection subscribed while no reader is open:
        # redis-py reads health-check replies from the subscribing thread when it is not
        pubsub.subscribe(f"{keys.PREFIX}:subscriber:{uuid.uuid4().hex}")
        self._pubsub = pubsub
        stop = self._stop
        pump = lambda: self._pump(pubsub, stop)  # noqa: E731
        start_loop("subscriber", pump, stop, self.health, 0.0, (redis.RedisError,))
        return pubsub

    def _drop(self, inbox: Inbox) -> bool:
        """Forget ``inbox``; True when it was its channel's last one."""
        readers = self._inboxes.get(inbox.channel, [])
        if inbox in readers:
            readers.remove(inbox)
        if readers:
            return False
        self._inboxes.pop(inbox.channel, None)
        return True

    def _let_go(self) -> None:
        """Unsubscribe the channels nobody reads (kept for later when Redis is away)."""
        try:
            self._pubsub.unsubscribe(*self._unsubscribe)
            self._unsubscribe.clear()
        except redis.RedisError:
            pass

    # -- the reading thread -------------------------------------------------------------
    def _pump(self, pubsub: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                message = pubsub.get_message(timeout=self.WAIT_S)
            except Exception:
                if stop.is_set():  # closed under it: the client is closing
                    return
                raise  # the loop logs it and reads again after a pause
            self.health.ok("subscriber")
            with self._lock:
                if self._unsubscribe and pubsub is self._pubsub:
                    self._let_go()
                if message is None:
                    continue
                channel = message.get("channel")
                if isinstance(channel, str):
                    channel = channel.encode()
                readers = list(self._inboxes.get(channel or b"", ()))
            for inbox in readers:
                inbox.queue.put(message)

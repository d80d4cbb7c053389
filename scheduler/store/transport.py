"""kombu's Redis transport and Celery's consumer, made robust to bad queue items and to a
Redis that goes away:

- a queue item that is not a message (not JSON, or not an envelope) is logged and dropped:
  kombu's own channel raises out of the consumer's event loop, and Celery then stops the
  whole worker ("Unrecoverable error") over one bad item;
- a message taken off a queue when Redis is full (its maxmemory reached) is handled without
  its unacknowledged record, and acknowledged here only: kombu raises, and Celery stops the
  worker, the message lost with it;
- giving back unacknowledged messages when the connection closes under them (Redis
  restarted) is best effort: kombu's raises (its connection is already gone) and Celery
  stops the worker; the messages stay in Redis's unacked index, and the visibility-timeout
  sweep gives them back;
- a consumer that lost Redis tries again every quarter second, up to one second apart
  (Celery's default waits 2, 4, 6 … s, so a worker came back up to 6 s after Redis did);
- a channel publishes through one Redis client, not a new one per message;
- a worker's task events (Flower's) go out a moment after they are made, not at once: a
  job's "received" and "started" events were published while its first step ran.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual

from scheduler.store.headroom import is_full

log = logging.getLogger("ggufq.transport")
_NOT_A_MESSAGE = (ValueError, TypeError, KeyError, AttributeError)
# a consumer whose broker went away tries again this often (seconds): every 0.25 s at most,
# so that it takes messages again within a quarter second of Redis answering (the issue's
# "serves again within 1 s"); a refused connect or a LOADING reply costs Redis little
RECONNECT = {"interval_start": 0.1, "interval_step": 0.05, "interval_max": 0.25}
EVENTS_AFTER_S = 0.05  # past a short job's first token


class QoS(kombu_redis.QoS):
    def append(self, message: Any, delivery_tag: Any) -> None:
        """Record a message taken off a queue as unacknowledged; when Redis refuses that for
        memory, the message is handled all the same, without the record (it is this
        process's now: raising would stop the worker and lose it)."""
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        except Exception as exc:
            if not is_full(exc):
                raise
            log.warning(
                "Redis is full: message %s is handled without its unacked record", delivery_tag
            )
            kombu_virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        except Exception as exc:
            if not is_full(exc):
                raise
            # its record stays, given back after the visibility timeout; the job's placement
            # claim places it once however often it comes
            log.warning("Redis is full: message %s acknowledged here only", delivery_tag)
            kombu_virtual.QoS.ack(self, delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)  # type: ignore[no-untyped-call]
        except Exception as exc:  # any failure here would stop the worker
            delivered: dict[Any, Any] = self._delivered  # type: ignore[assignment]
            log.warning(
                "could not give back %d unacknowledged messages now (%r); Redis gives them "
                "back after the visibility timeout",
                len(delivered),
                exc,
            )
            delivered.clear()


class Channel(kombu_redis.Channel):
    QoS = QoS
    _publisher: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """One Redis client per channel for publishing (kombu's makes a new one for every
        message, which costs more than the LPUSH it sends; both share the pool)."""
        if client is not None:
            yield client
            return
        if self._publisher is None or self._publisher.connection_pool is not self.pool:
            self._publisher = self._create_client()  # type: ignore[no-untyped-call]
        yield self._publisher

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        except _NOT_A_MESSAGE as exc:  # the item was already popped: nothing to put back
            log.error("dropped a queue item that is not a Celery message: %r", exc)
            return True


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(kombu_redis.SentinelChannel, Channel):
    """The channel above, whose connections go to the primary its sentinels name."""


class SentinelTransport(Transport):
    """The transport above behind Sentinel (``redis+sentinel://``: scheduler/store/sentinel.py)."""

    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port  # type: ignore[assignment]


class Consumer(CeleryConsumer):  # type: ignore[misc]
    _events_due_at = 0.0  # when the flush set last is due; 0: none is set

    def on_send_event_buffered(self) -> None:
        if self.hub is not None:  # from any thread: the loop's own thread sets the timer
            self.hub.call_soon(self._events_later)

    def _events_later(self) -> None:
        now = time.monotonic()
        if self._events_due_at and now < self._events_due_at + 1.0:
            return  # one is set (one lost with the loop's timers, as Redis went away, is not)
        self._events_due_at = now + EVENTS_AFTER_S
        self.hub.call_later(EVENTS_AFTER_S, self._events_now)

    def _events_now(self) -> None:
        self._events_due_at = 0.0
        self._flush_events()

    def ensure_connected(self, conn: Any) -> Any:
        conn.ensure_connection = partial(conn.ensure_connection, **RECONNECT)
        return super().ensure_connected(conn)

"""A job's first chunk: sent from the text relay's thread, its answer read on the writer's.

A job's first chunk carries its time to first token, so it goes to Redis from the thread
that made it, at once: the chunk writer's threads run at a lower priority and would wait out
a decode step on a busy CPU (10 ms of the demo model's time to first token on 2 cores).
Waiting there for Redis's answer, though, cost the decode step a round trip (0.3-0.5 ms of a
2 ms step at 32 sequences of a tiny model: bench/step_split.py, when the decode thread made
the text; now the text relay does, workers/engine/relay.py). So that thread only sends the
command, on a connection of its own, and queues a :class:`Sent` for the writer; the writer
reads the answers in the order they were sent, before it writes anything queued after them
(:meth:`FirstChunks.answers`). A chunk whose answer says it did not run (Redis lost the
script), or whose answer did not come in time, is written again by the writer ahead of the
job's later chunks; append.lua skips a copy that had landed. After a send or an answer that
failed, first chunks go through the writer's threads for a while, so that a slow Redis holds
up the text relay (and decoding, once the relay is LAG steps behind) at most once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.sentinel

from scheduler.store.streams import Appended, append_command
from workers.pending import Pending

log = logging.getLogger(__name__)


class Sent:
    """A first chunk sent from a text relay whose answer the writer has yet to read."""

    __slots__ = ("pending", "generation", "source")

    def __init__(self, pending: Pending, generation: int, source: FirstChunks) -> None:
        self.pending = pending
        self.generation = generation  # of the connection it was sent on
        self.source = source  # what sent it: its answer is read there


class FirstChunks:
    """First chunks sent on one connection of their own, and their answers read in order."""

    TIMEOUT_S = 0.25  # a send, or an answer, waits no longer for Redis
    PAUSE_S = 5.0  # after one that failed, first chunks go through the writer this long

    def __init__(self, client: redis.Redis) -> None:
        self.client = quick_client(client, self.TIMEOUT_S)
        self.paused_until = 0.0
        self._lock = threading.Lock()  # a send, and the reading of answers, one at a time
        self._conn: Any = None
        self._generation = 0  # raised when the connection is dropped: its answers are lost
        self._owed = 0  # answers of this connection not read yet

    def send(self, pending: Pending, then: Callable[[Sent], None]) -> bool:
        """Send ``pending`` (a job's first chunk) and call ``then`` with its :class:`Sent`
        (the writer's queue: answers are read in the order of those calls); False when it
        was not sent (paused, the connection busy or failing): then the writer takes it."""
        if time.monotonic() < self.paused_until or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._conn is None:
                self._conn = self.client.connection_pool.get_connection()
            p = pending
            command = append_command(self.client, p.job_id, p.seq, p.chunk, p.ttl_s, p.fence)
            # redis-py's health check (a PING after an idle spell) reads its answer at once:
            # only when no chunk's answer is owed, which it would read instead
            self._conn.send_command(*command, check_health=self._owed == 0)
            pending.taken, pending.written_at = True, time.time()  # in Redis a moment later
            self._owed += 1
            then(Sent(pending, self._generation, self))
            return True
        except (redis.RedisError, OSError) as exc:
            log.warning("sending a first chunk at once failed (%s); the writer takes it", exc)
            self._drop()
            return False
        finally:
            self._lock.release()

    def answers(self, sent: list[Sent]) -> tuple[list[Pending], list[Pending]]:
        """Read the answers to ``sent`` (in the order sent): the chunks to write again
        (not run, or no answer in time), and those refused for their fence."""
        again: list[Pending] = []
        fenced: list[Pending] = []
        with self._lock:
            for item in sent:
                if item.generation != self._generation or self._conn is None:
                    again.append(item.pending)  # its connection was dropped: answer lost
                    continue
                self._owed -= 1
                try:
                    appended = Appended(int(self._conn.read_response()))
                except redis.ResponseError as exc:  # it did not run (NOSCRIPT): write it
                    log.info("a first chunk sent at once did not run (%s): written again", exc)
                    again.append(item.pending)
                    continue
                except Exception as exc:  # late, the connection lost, or not an answer of
                    # append.lua's: this one and those after it on the connection are unknown
                    log.warning("a first chunk's answer did not come (%r): written again", exc)
                    again.append(item.pending)
                    self._drop()
                    continue
                if appended is Appended.FENCED:
                    fenced.append(item.pending)
        return again, fenced

    def stop(self) -> None:
        """Send no more (the writer is closing: it reads the answers owed, then ends)."""
        with self._lock:
            self.paused_until = float("inf")

    def close(self) -> None:
        with self._lock:
            self._drop()
            self.paused_until = float("inf")
        self.client.close()

    def _drop(self) -> None:
        """Forget the connection (and the answers it still owes): the next send opens
        another, after the pause."""
        self.paused_until = max(self.paused_until, time.monotonic() + self.PAUSE_S)
        self._generation += 1
        self._owed = 0
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
            self.client.connection_pool.release(conn)


def quick_client(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """A client of the same server as ``client`` (same connection settings, TLS included)
    whose reads and connects give up after ``timeout_s``."""
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs, socket_timeout=timeout_s)
    kwargs["socket_connect_timeout"] = timeout_s
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):  # the primary it names
        named = redis.sentinel.SentinelConnectionPool(  # its class: TLS's behind rediss
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            **kwargs,
        )
        return redis.Redis(connection_pool=named)
    quick = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=quick)

"""The reader leases of a process, renewed together: one pipeline a second for every lease
that is due, from one asyncio task (:class:`Leases`: the gateway's streaming requests) or one
thread (:class:`ThreadLeases`: the Python client's streams), apart from the readers' own
pace, so that a consumer that takes its time between chunks keeps its job.

Each reader renewing its own lease made a round trip per reader every few seconds; with
thousands of readers waiting behind a few connections the renewals queued past the lease's
life, and placement cancelled jobs whose readers were still there. Here the cost is one
round trip a second, whatever the number of readers; a lease let go of is removed by the
same task, after any renewal of it already on its way (never before: it would come back).
A reader whose consumer has not taken its last chunk for READER_STUCK_S (a client that
stopped reading) is not renewed: its job is cancelled as if the reader had gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import redis.asyncio

from scheduler.loops import stop_task
from scheduler.store.cancel import READER_STUCK_S, ReaderLease, queue_cancel

log = logging.getLogger(__name__)
EVERY_S = 1.0
BATCH = 1000  # leases per pipeline
# a renewal's reply waited for at most this long on the thread's own connection (one that
# stops answering is given up on, and every lease renewed again, well within a lease)
LEASE_REPLY_S = 1.0


class Leases:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._held: dict[int, ReaderLease] = {}
        self._released: list[ReaderLease] = []
        self._cancels: dict[str, int] = {}  # job id -> its cancel flag's ttl
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def hold(self, lease: ReaderLease) -> None:
        """Keep ``lease`` renewed until :meth:`let_go` (its first renewal within a second)."""
        self._held[id(lease)] = lease
        self._start()

    def let_go(self, lease: ReaderLease, keep: bool = False) -> None:
        """The reader is done: its lease is no longer renewed, and is removed within a
        second, or, with ``keep``, left to lapse (its job is then cancelled, as for a reader
        that went away: one that gave up before its job ended)."""
        if self._held.pop(id(lease), None) is None or lease.renewed_at is None or keep:
            return
        self._released.append(lease)
        self._start()

    def cancel(self, job_id: str, ttl_s: int) -> None:
        """Cancel the job as soon as Redis answers (its reader lost Redis right after the
        job was made, perhaps before its lease was first written: without this the job
        would run unread, beside the client's retry)."""
        self._cancels[job_id] = ttl_s
        self._start()

    async def aclose(self) -> None:
        self._closed = True
        await stop_task(self._task)
        with contextlib.suppress(Exception):  # the last ones, once
            await self._send([], self._released, dict(self._cancels))

    def _start(self) -> None:
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="ggufq-reader-leases")

    async def _run(self) -> None:
        while self._held or self._released or self._cancels:
            now = time.monotonic()
            due = [lease for lease in self._held.values() if _renews(lease, now)]
            gone, self._released = self._released, []
            cancels, self._cancels = self._cancels, {}
            try:
                await self._send(due, gone, cancels)
            except Exception as exc:  # Redis away: all of them again next time
                for lease in due:
                    lease.renewed_at = None
                self._released += gone
                self._cancels.update(cancels)
                log.warning("renewing %d reader leases failed: %s", len(due), exc)
            await asyncio.sleep(EVERY_S)

    async def _send(
        self, due: list[ReaderLease], gone: list[ReaderLease], cancels: dict[str, int]
    ) -> None:
        for ops in _batches(due, gone, cancels):
            pipe = self.client.pipeline(transaction=False)
            for op in ops:
                op(pipe)
            await pipe.execute()


class ThreadLeases:
    """:class:`Leases` for a process without an event loop: one daemon thread on a
    connection of its own (``client``: no wait behind the process's other commands, a
    reply given up on after LEASE_REPLY_S), started on the first lease held and gone once
    none is left."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._held: dict[int, ReaderLease] = {}
        self._released: list[ReaderLease] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, lease: ReaderLease) -> None:
        with self._lock:
            self._held[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():  # or forked away
                self._thread = threading.Thread(
                    target=self._run, name="ggufq-reader-leases", daemon=True
                )
                self._thread.start()

    def let_go(self, lease: ReaderLease, keep: bool = False) -> None:
        """The reader is done: its lease is removed now, and again after any renewal of it
        on its way (see :meth:`Leases.let_go`); with ``keep``, left to lapse (its job is
        then cancelled: a reader that gave up and could not say so)."""
        with self._lock:
            if self._held.pop(id(lease), None) is None or keep:
                return
            self._released.append(lease)
        with contextlib.suppress(Exception):  # at once, as a process may end right after
            self._execute(_batches([], [lease], {}))

    def close(self) -> None:
        """Remove the leases let go of, and stop renewing (the thread ends)."""
        with self._lock:
            self._held.clear()
            gone, self._released = self._released, []
        with contextlib.suppress(Exception):
            self._execute(_batches([], gone, {}))
        self.client.close()

    def _execute(self, batches: list[list[Callable[[Any], None]]]) -> None:
        for ops in batches:
            pipe = self.client.pipeline(transaction=False)
            for op in ops:
                op(pipe)
            pipe.execute()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._held and not self._released:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [lease for lease in self._held.values() if _renews(lease, now)]
                gone, self._released = self._released, []
            try:
                self._execute(_batches(due, gone, {}))
            except Exception as exc:  # Redis away: all of them again next time
                with self._lock:
                    for lease in due:
                        lease.renewed_at = None
                    self._released += gone
                log.warning("renewing %d reader leases failed: %s", len(due), exc)
            time.sleep(EVERY_S)


def _batches(
    due: list[ReaderLease], gone: list[ReaderLease], cancels: dict[str, int]
) -> list[list[Callable[[Any], None]]]:
    """In order: the cancels, the leases let go of, then the renewals, BATCH a pipeline."""
    now = time.monotonic()
    ops: list[Callable[[Any], None]] = [
        partial(queue_cancel, job_id=job_id, ttl_s=ttl_s) for job_id, ttl_s in cancels.items()
    ]
    ops += [lease.release for lease in gone]
    ops += [partial(lease.renew, now=now) for lease in due]
    return [ops[start : start + BATCH] for start in range(0, len(ops), BATCH)]


def _renews(lease: ReaderLease, now: float) -> bool:
    """Due, and its reader still reading (its consumer took its last chunk, or has had it
    for less than READER_STUCK_S, and for less than the lease when that is longer)."""
    since = None if lease.handed_at is None else now - lease.handed_at
    stuck = since is not None and since > max(READER_STUCK_S, lease.lease_s / 2)
    return lease.due(now) and not stuck

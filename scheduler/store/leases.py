"""The reader leases of an asyncio process (the gateway's streaming requests), renewed
together: one task, one pipeline a second for every lease that is due.

Each reader renewing its own lease made a round trip per reader every few seconds; with
thousands of readers waiting behind a few connections the renewals queued past the lease's
life, and placement cancelled jobs whose readers were still there. Here the cost is one
round trip a second, whatever the number of readers; a lease let go of is removed by the
same task, after any renewal of it already on its way (never before: it would come back).
A reader whose consumer has not taken its last chunk for half a lease (a client that
stopped reading) is not renewed: its job is cancelled as if the reader had gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio

from scheduler.store.cancel import ReaderLease

log = logging.getLogger(__name__)
EVERY_S = 1.0
BATCH = 1000  # leases per pipeline


class Leases:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._held: dict[int, ReaderLease] = {}
        self._released: list[ReaderLease] = []
        self._task: asyncio.Task[None] | None = None

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

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):  # the last ones let go of, once
            await self._send([], self._released)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="ggufq-reader-leases")

    async def _run(self) -> None:
        while self._held or self._released:
            now = time.monotonic()
            due = [lease for lease in self._held.values() if _renews(lease, now)]
            gone, self._released = self._released, []
            try:
                await self._send(due, gone)
            except Exception as exc:  # Redis away: all of them again next time
                for lease in due:
                    lease.renewed_at = None
                self._released += gone
                log.warning("renewing %d reader leases failed: %s", len(due), exc)
            await asyncio.sleep(EVERY_S)

    async def _send(self, due: list[ReaderLease], gone: list[ReaderLease]) -> None:
        now = time.monotonic()
        work = [(lease, False) for lease in gone] + [(lease, True) for lease in due]
        for start in range(0, len(work), BATCH):
            pipe = self.client.pipeline(transaction=False)
            for lease, renew in work[start : start + BATCH]:
                if renew:
                    lease.renew(pipe, now)
                else:
                    lease.release(pipe)
            await pipe.execute()


def _renews(lease: ReaderLease, now: float) -> bool:
    """Due, and its reader still reading (its consumer took its last chunk, or has had it
    for less than half a lease)."""
    stuck = lease.handed_at is not None and now - lease.handed_at > lease.lease_s / 2
    return lease.due(now) and not stuck

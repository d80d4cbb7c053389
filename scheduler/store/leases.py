"""The reader leases of an asyncio process (the gateway's streaming requests), renewed
together: one task, one pipeline a second for every lease that is due.

Each reader renewing its own lease made a round trip per reader every few seconds; with
thousands of readers waiting behind a few connections the renewals queued past the lease's
life, and placement cancelled jobs whose readers were still there. Here the cost is one
round trip a second, whatever the number of readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis
import redis.asyncio

from scheduler.store.cancel import ReaderLease

log = logging.getLogger(__name__)
EVERY_S = 1.0
BATCH = 1000  # leases per pipeline


class Leases:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._held: dict[int, ReaderLease] = {}
        self._task: asyncio.Task[None] | None = None

    def hold(self, lease: ReaderLease) -> None:
        """Keep ``lease`` renewed until :meth:`let_go` (its first renewal within a second)."""
        self._held[id(lease)] = lease
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._renew(), name="ggufq-reader-leases")

    async def let_go(self, lease: ReaderLease) -> None:
        """The reader is done: its lease is no longer renewed, and is removed (best effort:
        a lease left to lapse cancels a job that had ended or was cancelled anyway)."""
        self._held.pop(id(lease), None)
        if lease.renewed_at is None:
            return
        with contextlib.suppress(redis.RedisError, OSError):
            pipe = self.client.pipeline(transaction=False)
            lease.release(pipe)
            await pipe.execute()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _renew(self) -> None:
        while self._held:
            now = time.monotonic()
            due = [lease for lease in self._held.values() if lease.due(now)]
            for start in range(0, len(due), BATCH):
                pipe = self.client.pipeline(transaction=False)
                for lease in due[start : start + BATCH]:
                    lease.renew(pipe, now)
                try:
                    await pipe.execute()
                except (redis.RedisError, OSError) as exc:  # Redis away: due again next time
                    for lease in due[start : start + BATCH]:
                        lease.renewed_at = None
                    log.warning("renewing %d reader leases failed: %s", len(due), exc)
            await asyncio.sleep(EVERY_S)

"""The batches a gateway process drives: it looks for batches that no live process drives,
takes the lease of up to ``batch_drivers`` of them and drives each (driver.py); it also
deletes files past their expiry. Any number of gateway processes share the work: a batch
is driven by one at a time, and by another as soon as that one's lease lapses."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from api_client.aio import AsyncClient
from api_client.batches import spool
from api_client.batches.driver import LOOK_S, Driver, DriverSettings
from api_client.batches.files import FileStore, file_store
from api_client.batches.states import MAX_WINDOW_S
from api_client.batches.store import BatchStore
from scheduler.gguf.registry import Registry
from scheduler.settings import Settings

log = logging.getLogger("ggufq.batches")
EXPIRE_FILES_S = 300.0  # how often expired files are looked for


def batch_store(client: AsyncClient) -> BatchStore:
    return BatchStore(client.r, client.settings.batch_retention_s)


class BatchRunners:
    def __init__(
        self,
        client: AsyncClient,
        settings: Settings,
        store: BatchStore | None = None,
        files: FileStore | None = None,
        registry: Registry | None = None,
    ) -> None:
        """``store``, ``files`` and ``registry``: a gateway's own, else made here."""
        self.client = client
        self.store = store or batch_store(client)
        self.files = files or file_store(settings)
        self.registry = registry or Registry(settings.models_dir)
        self.most = settings.batch_drivers
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.driver_settings = DriverSettings(
            concurrency=settings.batch_concurrency,
            lease_s=settings.batch_lease_s,
            retention_s=settings.batch_retention_s,
            max_lines=settings.batch_max_lines,
        )
        self.driving: dict[str, asyncio.Task[None]] = {}
        self._expired_at = 0.0

    async def run(self) -> None:
        """Look for batches to drive every LOOK_S, for ever (cancel to stop)."""
        while True:
            try:
                await self.look()
            except Exception as exc:  # Redis away, the data directory unreadable: next look
                log.warning("looking for batches to drive failed: %s", exc)
            await asyncio.sleep(LOOK_S)

    async def look(self) -> None:
        for batch_id in await self.store.active():
            if len(self.driving) >= self.most:
                break
            if batch_id in self.driving:
                continue
            lease_s = self.driver_settings.lease_s
            if await self.store.lease(batch_id, self.holder, "take", lease_s):
                self._drive(batch_id)
        if time.monotonic() - self._expired_at > EXPIRE_FILES_S:
            self._expired_at = time.monotonic()
            await self._expire_files()

    def _drive(self, batch_id: str) -> None:
        driver = Driver(
            self.client,
            self.store,
            self.files,
            batch_id,
            self.holder,
            self.driver_settings,
            self.registry.first_name,
        )
        task = asyncio.create_task(self._guarded(driver), name=f"batch-{batch_id}")
        self.driving[batch_id] = task
        task.add_done_callback(lambda _task: self.driving.pop(batch_id, None))

    async def _guarded(self, driver: Driver) -> None:
        try:
            await driver.run()
        except Exception:  # its lease is given back: a look takes it up again
            log.exception("driving batch %s failed; it will be taken up again", driver.id)

    async def _expire_files(self) -> None:
        await self.store.forget(time.time() - self.driver_settings.retention_s - 2 * 86400)
        active = await self.store.active_batches()
        keep = {batch.doc["input_file_id"] for batch in active}
        gone = await asyncio.to_thread(self.files.expire, time.time(), keep)
        # what drivers that died left, once no batch can still need it
        root, keep_s = self.files.root.parent, self.driver_settings.retention_s + MAX_WINDOW_S
        ids = frozenset(batch.id for batch in active)
        gone += await asyncio.to_thread(spool.remove, root, "*", keep_s, ids)
        if gone:
            log.info("deleted %d expired batch files", gone)

    async def close(self) -> None:
        """Stop driving (the leases are given back: another process goes on at once)."""
        tasks = list(self.driving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

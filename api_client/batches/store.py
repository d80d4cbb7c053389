"""Server-side batches in Redis: each batch's record, its driver's lease and what the driver
wrote of each line, read and moved only through lua/batch_*.lua (see states.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import redis.asyncio

from api_client.batches.states import BatchState, Mover, sources
from scheduler.errors import Conflict, NotFound
from scheduler.store import keys
from scheduler.store.records import decoded, text
from scheduler.store.scripts import flatten, script

_COUNTERS = ("total", "completed", "failed")
log = logging.getLogger(__name__)
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


class Moved(StrEnum):
    """What a move of a batch came to (lua/batch_move.lua)."""

    MOVED = "moved"
    SAME = "same"  # it was in that state already (a reply lost, or two asked at once)
    REFUSED = "refused"  # the table has no such move from the state it is in
    LEASE = "lease"  # the driver asking no longer holds the batch
    MISSING = "missing"


class Written(StrEnum):
    """What a driver's write of one line came to (lua/batch_line.lua)."""

    WRITTEN = "written"
    KEPT = "kept"  # the line had one: that one stands
    LEASE = "lease"


@dataclass(frozen=True)
class Batch:
    """A batch as its record holds it."""

    id: str
    state: BatchState
    doc: dict[str, Any]  # what it was created with: endpoint, input file, window, tenant ...
    fields: dict[str, str]

    @property
    def tenant(self) -> str:
        return str(self.doc.get("tenant", "default"))

    @property
    def expires_at(self) -> int:
        return int(self.doc["expires_at"])

    def count(self, name: str) -> int:
        return int(self.fields.get(name, 0))

    def at(self, state: BatchState) -> int | None:
        value = self.fields.get(f"{state}_at")
        return int(value) if value else None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        doc, fields = self.doc, self.fields
        errors = json.loads(fields["errors"]) if fields.get("errors") else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": doc["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": doc["input_file_id"],
            "completion_window": doc["completion_window"],
            "status": self.state.value,
            "output_file_id": fields.get("output_file_id") or None,
            "error_file_id": fields.get("error_file_id") or None,
            "created_at": doc["created_at"],
            "in_progress_at": self.at(BatchState.IN_PROGRESS),
            "expires_at": doc["expires_at"],
            "finalizing_at": self.at(BatchState.FINALIZING),
            "completed_at": self.at(BatchState.COMPLETED),
            "failed_at": self.at(BatchState.FAILED),
            "expired_at": self.at(BatchState.EXPIRED),
            "cancelling_at": self.at(BatchState.CANCELLING),
            "cancelled_at": self.at(BatchState.CANCELLED),
            "request_counts": {name: self.count(name) for name in _COUNTERS},
            "metadata": doc.get("metadata"),
        }


class BatchStore:
    def __init__(self, r: redis.asyncio.Redis, retention_s: float) -> None:
        self.r = r
        self.retention_s = int(retention_s)
        self._move = script(r, "batch_move")
        self._line = script(r, "batch_line")
        self._lease = script(r, "batch_lease")

    async def create(self, doc: dict[str, Any]) -> Batch:
        batch = new_batch(doc)
        pipe = self.r.pipeline(transaction=True)
        queue_create(pipe, batch)
        await pipe.execute()
        return batch

    async def get(self, batch_id: str, tenant: str | None = None) -> Batch:
        """The batch; ``tenant`` given: only that tenant's (else NotFound, as for none)."""
        checked(batch_id)  # before a read: another key of ours is no batch
        return batch_of(batch_id, await self.r.hgetall(keys.batch(batch_id)), tenant)

    async def listing(self, tenant: str | None, limit: int, after: str | None) -> list[Batch]:
        """Batches newest first, ``limit`` of them, those older than ``after``."""
        ids = [text(i) for i in cast(list[bytes], await self.r.zrevrange(keys.BATCHES, 0, -1))]
        if after in ids:
            ids = ids[ids.index(after) + 1 :]
        found: list[Batch] = []
        for batch_id in ids:
            try:
                found.append(await self.get(batch_id, tenant))
            except NotFound:
                if not await self.r.exists(keys.batch(batch_id)):  # expired: forgotten
                    await self.r.zrem(keys.BATCHES, batch_id)
                continue
            if len(found) >= limit:
                break
        return found

    async def forget(self, before: float) -> None:
        """Drop from the listing's index batches created before ``before`` (their records
        expired: kept retention_s after their end, which is at most a window after)."""
        await self.r.zremrangebyscore(keys.BATCHES, "-inf", before)

    async def active(self) -> list[str]:
        return sorted(text(i) for i in await self.r.smembers(keys.BATCHES_ACTIVE))

    async def drop_gone(self, batch_id: str) -> None:
        """Take a batch whose record is gone (or not whole) out of the batches not ended,
        which drivers look through: nothing is left of it to drive."""
        log.error("batch %s has no readable record left: no driver takes it up", batch_id)
        await self.r.srem(keys.BATCHES_ACTIVE, batch_id)

    async def active_batches(self, tenant: str | None = None) -> list[Batch]:
        """The batches not ended (``tenant`` given: that tenant's), in one round trip."""
        ids = await self.active()
        pipe = self.r.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))
        found = []
        for batch_id, raw in zip(ids, await pipe.execute(), strict=True):
            with contextlib.suppress(NotFound):  # its record gone (expired, or Redis lost it)
                found.append(batch_of(batch_id, raw, tenant))
        return found

    async def move(
        self,
        batch_id: str,
        target: BatchState,
        by: Mover,
        holder: str = "",
        **fields: Any,
    ) -> tuple[Moved, BatchState | None]:
        """Move the batch to ``target`` if the table lets ``by`` from where it is (and
        ``holder`` holds its lease, for the driver's moves); returns what came of it and the
        state it was in."""
        names, args = move_call(batch_id, target, by, holder, self.retention_s, fields)
        return moved_of(await self._move(keys=names, args=args))

    async def lease(self, batch_id: str, holder: str, op: str, lease_s: float) -> bool:
        held = await self._lease(
            keys=[keys.batch_lease(batch_id)], args=[holder, op, int(lease_s * 1000)]
        )
        return bool(held)

    async def write_sent(
        self, batch_id: str, holder: str, line: int, value: str
    ) -> tuple[Written, str]:
        return await self._write(keys.batch_sent(batch_id), batch_id, holder, line, value, "")

    async def write_end(
        self, batch_id: str, holder: str, line: int, value: str, counter: str
    ) -> tuple[Written, str]:
        return await self._write(keys.batch_out(batch_id), batch_id, holder, line, value, counter)

    async def _write(
        self, key: str, batch_id: str, holder: str, line: int, value: str, counter: str
    ) -> tuple[Written, str]:
        lease_key, record = keys.batch_lease(batch_id), keys.batch(batch_id)
        outcome, kept = await self._line(
            keys=[lease_key, key, record], args=[holder, line, value, counter]
        )
        return Written(text(outcome)), text(kept)

    async def sent(self, batch_id: str) -> dict[int, str]:
        raw = await self.r.hgetall(keys.batch_sent(batch_id))
        return {int(k): text(v) for k, v in raw.items()}

    async def ends(self, batch_id: str) -> dict[int, str]:
        raw = await self.r.hgetall(keys.batch_out(batch_id))
        return {int(k): text(v) for k, v in raw.items()}


def new_batch(doc: dict[str, Any]) -> Batch:
    """A new batch (validating) of ``doc``: its endpoint, input file, window and tenant."""
    batch_id = "batch_" + uuid.uuid4().hex[:24]
    doc = {**doc, "id": batch_id, "created_at": int(time.time())}
    fields = {"state": BatchState.VALIDATING.value, "doc": json.dumps(doc)}
    return Batch(batch_id, BatchState.VALIDATING, doc, fields)


def queue_create(pipe: Any, batch: Batch) -> None:
    """Queue the new batch's record and index entries on a pipeline (sync or asyncio)."""
    pipe.hset(keys.batch(batch.id), mapping=cast(dict[Any, Any], batch.fields))
    pipe.zadd(keys.BATCHES, {batch.id: batch.doc["created_at"]})
    pipe.sadd(keys.BATCHES_ACTIVE, batch.id)


def checked(batch_id: str) -> str:
    """``batch_id``, if it is a batch's id (else NotFound)."""
    if not _BATCH_ID.fullmatch(batch_id):
        raise _not_found(batch_id)
    return batch_id


def batch_of(batch_id: str, raw: dict[Any, Any], tenant: str | None) -> Batch:
    """The batch its record ``raw`` holds; NotFound for none, or another tenant's."""
    if not raw or not _BATCH_ID.fullmatch(batch_id):
        raise _not_found(batch_id)
    fields = decoded(raw)
    try:
        batch = Batch(batch_id, BatchState(fields["state"]), json.loads(fields["doc"]), fields)
    except (KeyError, ValueError):  # not whole: as good as none
        raise _not_found(batch_id) from None
    if tenant is not None and batch.tenant != tenant:
        raise _not_found(batch_id)
    return batch


def check_cancel(batch_id: str, moved: Moved, before: BatchState | None) -> None:
    """A cancel refused for a batch that ended otherwise (not already cancelled): Conflict."""
    if moved is Moved.REFUSED and before is not BatchState.CANCELLED:
        raise Conflict(f"batch {batch_id} is {before}: only a batch not yet ended can be cancelled")


def move_call(
    batch_id: str,
    target: BatchState,
    by: Mover,
    holder: str,
    retention_s: int,
    fields: dict[str, Any],
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of lua/batch_move.lua for a move (from the move table)."""
    allowed = ",".join(s.value for s in sources(target, by))
    names = [
        keys.batch(batch_id),
        keys.BATCHES_ACTIVE,
        keys.batch_lease(batch_id),
        keys.batch_sent(batch_id),
        keys.batch_out(batch_id),
    ]
    return names, [holder, target.value, allowed, retention_s, *flatten(fields)]


def moved_of(reply: list[Any]) -> tuple[Moved, BatchState | None]:
    outcome, before = reply
    return Moved(text(outcome)), BatchState(text(before)) if before else None


def _not_found(batch_id: str) -> NotFound:
    return NotFound(f"no batch {batch_id[:80]!r} (it ended long ago, or it is another key's)")

"""Server-side batches from Python: ``Client.submit_batch(path)`` uploads an input file
(OpenAI's Batch API lines) into GGUFQ_DATA_DIR and creates the batch; the handle it returns
reads where the batch stands, waits for it with progress, cancels it and reads its results.
The batch runs on the cluster (a gateway process drives it): this process may exit."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import redis

from api_client.batches.files import file_store
from api_client.batches.states import BatchState, Mover, batch_doc
from api_client.batches.store import (
    Batch,
    batch_of,
    check_cancel,
    checked,
    move_call,
    moved_of,
    new_batch,
    queue_create,
)
from scheduler.errors import InvalidRequest, JobTimeout, NotFound
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.scripts import script

Progress = Callable[[dict[str, Any]], None]


class BatchHost(Protocol):
    """What a handle needs of its client (``Client`` is one)."""

    r: redis.Redis
    settings: Settings
    tenant: str
    weight: float


def submit_batch(
    client: BatchHost,
    path: str | Path,
    endpoint: str | None = None,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
) -> BatchHandle:
    """Upload ``path`` and start a batch over it (see :meth:`Client.submit_batch`)."""
    settings = client.settings
    data = Path(path).read_bytes()
    endpoint = endpoint or _endpoint_of(data)
    made = (endpoint, completion_window, metadata, client.tenant, client.weight)
    doc = batch_doc(*made, time.time())  # checked before the file is stored
    files = file_store(settings)
    meta = files.create(data, Path(path).name, "batch", client.tenant, settings.batch_retention_s)
    batch = new_batch({**doc, "input_file_id": meta["id"]})
    pipe = client.r.pipeline(transaction=True)
    queue_create(pipe, batch)
    pipe.execute()
    return BatchHandle(client, batch.id)


def _endpoint_of(data: bytes) -> str:
    for raw in data.split(b"\n"):
        if raw.strip():
            try:
                return str(json.loads(raw)["url"])
            except (ValueError, KeyError, TypeError):
                break
    raise InvalidRequest(
        "the file's first line names no url: give endpoint=, e.g. /v1/chat/completions"
    )


class BatchHandle:
    """A batch on the cluster: ``BatchHandle(client, batch_id)`` finds one made elsewhere."""

    def __init__(self, client: BatchHost, batch_id: str) -> None:
        self.client = client
        self.id = batch_id

    def __repr__(self) -> str:
        return f"BatchHandle({self.id!r})"

    def _batch(self) -> Batch:
        return batch_of(self.id, self.client.r.hgetall(keys.batch(checked(self.id))), None)

    def status(self) -> dict[str, Any]:
        """OpenAI's batch object: ``status``, ``request_counts``, file ids, times."""
        return self._batch().as_openai()

    def wait(
        self, timeout: float | None = None, on_progress: Progress | None = None
    ) -> dict[str, Any]:
        """Wait until the batch has ended (completed, failed, expired or cancelled);
        ``on_progress`` gets the batch object each time its state or counts change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: tuple[Any, ...] = ()
        while True:
            batch = self._batch()
            now = (batch.state, batch.count("completed"), batch.count("failed"))
            if on_progress is not None and now != seen:
                on_progress(batch.as_openai())
            seen = now
            if batch.state.ended:
                return batch.as_openai()
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(
                    f"batch {self.id} has not ended after {timeout} s; it goes on: wait() again"
                )
            time.sleep(0.25)

    def cancel(self) -> dict[str, Any]:
        """Stop the batch: its jobs are cancelled, what ended is kept in its files."""
        r, settings = self.client.r, self.client.settings
        fields: dict[str, Any] = {}
        names, args = move_call(
            self.id,
            BatchState.CANCELLING,
            Mover.CALLER,
            "",
            int(settings.batch_retention_s),
            fields,
        )
        moved, before = moved_of(script(r, "batch_move")(keys=names, args=args))
        check_cancel(self.id, moved, before)
        return self.status()

    def results(self) -> list[dict[str, Any]]:
        """Every line of its output and error files (each custom_id once), in input order."""
        batch = self._batch()
        settings = self.client.settings
        files = file_store(settings)
        found: list[dict[str, Any]] = []
        for name in ("output_file_id", "error_file_id"):
            if batch.fields.get(name):
                data = files.content(batch.fields[name], None)
                found += [json.loads(x) for x in data.splitlines() if x.strip()]
        order: dict[str, int] = {}
        with contextlib.suppress(NotFound, ValueError, AttributeError):  # input gone: as found
            for n, raw in enumerate(files.content(batch.doc["input_file_id"], None).splitlines()):
                if raw.strip():
                    order.setdefault(json.loads(raw).get("custom_id"), n)
        return sorted(found, key=lambda line: order.get(line["custom_id"], len(order)))


def recent_batches(client: BatchHost, limit: int = 20) -> list[Batch]:
    """The newest batches (every tenant's), newest first."""
    ids = client.r.zrevrange(keys.BATCHES, 0, limit - 1)
    found = []
    for raw_id in ids:
        batch_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        with contextlib.suppress(NotFound):  # ended long ago: its record expired
            found.append(batch_of(batch_id, client.r.hgetall(keys.batch(batch_id)), None))
    return found

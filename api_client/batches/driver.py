"""The driver of one server-side batch: while it holds the batch's lease it moves the batch
through its states (states.py), running its lines as batch-priority jobs of the batch's
tenant, ``batch_concurrency`` at a time.

Every step starts from the batch's record, so a driver that dies is replaced by another
that goes on where it stood: a line's job id is the batch's id and the line's, and the time
it was sent is written before it is sent, so a line's job is sent once and a new driver
waits for it instead of sending another; a line's end is written once (lua/batch_line.lua).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from api_client.batches import spool
from api_client.batches.answers import answer_of, job_of, line_error
from api_client.batches.files import FileStore
from api_client.batches.lines import (
    Line,
    LineError,
    lost_line,
    output_line,
    read_lines,
    run_order,
    unrun_line,
)
from api_client.batches.spool import Spool
from api_client.batches.states import BatchState, Mover
from api_client.batches.store import Batch, BatchStore, Moved, Written
from scheduler.errors import (
    InvalidRequest,
    NotFound,
    NoWorkers,
    RedisUnavailable,
    ServerBusy,
)
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.records import text

log = logging.getLogger("ggufq.batches")
LOOK_S = 1.0  # how often a running batch's driver looks for a cancel or its window's end
_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # waits before a send (or a spool write) is tried again
_MAX_BATCH_ERRORS = 1000  # a refused input file reports this many of its lines' problems
B = BatchState
T = TypeVar("T")


class LeaseLost(Exception):
    """The driver no longer holds its batch (another process took it): it stops at once,
    leaving the jobs it sent running for the new driver to wait for."""


@dataclass(frozen=True)
class DriverSettings:
    concurrency: int  # lines in flight at once
    lease_s: float
    retention_s: float  # how long an ended batch and its files are kept
    max_lines: int


class Driver:
    def __init__(
        self,
        client: AsyncClient,
        store: BatchStore,
        files: FileStore,
        batch_id: str,
        holder: str,
        settings: DriverSettings,
        first_name: Callable[[str], str] = str,
    ) -> None:
        self.client, self.store, self.files = client, store, files
        self.first_name = first_name  # names of one model file share its runners
        self.id, self.holder, self.settings = batch_id, holder, settings
        self._lines: list[Line] | None = None
        self._cancel_jobs = False  # when the lines' tasks stop: cancel their jobs too?
        self.spool = Spool(files.root.parent, batch_id, uuid.uuid4().hex[:8])

    async def run(self) -> None:
        """Drive the batch until it ends or the lease is lost; gives the lease back."""
        keeper = asyncio.create_task(self._keep_lease())
        driving = asyncio.create_task(self._drive())
        try:
            done, _ = await asyncio.wait({keeper, driving}, return_when=asyncio.FIRST_COMPLETED)
            if keeper in done:  # the lease was lost: stop driving, write nothing more
                driving.cancel()
                with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                    await driving
                log.warning("batch %s: this process lost its lease; another goes on", self.id)
            else:
                driving.result()
        except LeaseLost:
            log.warning("batch %s: this process lost its lease; another goes on", self.id)
        finally:
            driving.cancel()
            keeper.cancel()
            await asyncio.gather(driving, keeper, return_exceptions=True)
            await asyncio.to_thread(self.spool.close)
            with contextlib.suppress(Exception):
                await self.store.lease(self.id, self.holder, "release", self.settings.lease_s)

    async def _keep_lease(self) -> None:
        """Renew the lease; return once it is lost (another holds it, or Redis did not
        answer for as long as the lease lasts: the lease has lapsed there too)."""
        every = self.settings.lease_s / 3
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(every)
            try:
                if not await self.store.lease(self.id, self.holder, "renew", self.settings.lease_s):
                    return
                renewed = time.monotonic()
            except Exception as exc:
                log.warning("batch %s: renewing its lease failed: %s", self.id, exc)
                if time.monotonic() - renewed >= self.settings.lease_s - every:
                    return

    async def _drive(self) -> None:
        steps = {
            B.VALIDATING: self._validate,
            B.IN_PROGRESS: self._run_lines,
            B.FINALIZING: self._finalize,
            B.CANCELLING: self._cancel,
        }
        try:
            batch = await self.store.get(self.id)
        except NotFound:  # its record gone (expired, Redis lost it) or not whole: no driver
            return await self.store.drop_gone(self.id)  # can take it up: not looked at again
        while not batch.state.ended:
            await steps[batch.state](batch)
            batch = await self.store.get(self.id)

    async def _move(self, target: BatchState, **fields: Any) -> None:
        moved, before = await self.store.move(self.id, target, Mover.DRIVER, self.holder, **fields)
        if moved is Moved.LEASE:
            raise LeaseLost(self.id)
        if moved is Moved.REFUSED:  # a caller moved it meanwhile (cancel): the next step sees
            log.info("batch %s: not moved to %s from %s", self.id, target, before)

    async def _read(self, batch: Batch) -> tuple[list[Line], list[LineError]]:
        """The batch's lines, or its input's problems (one: the file is gone)."""
        if self._lines is not None:
            return self._lines, []
        input_id = batch.doc["input_file_id"]
        try:
            data = await asyncio.to_thread(self.files.content, input_id, None)
        except NotFound:
            return [], [LineError(0, "input_file_missing", f"the input file {input_id} is gone")]
        lines, errors = await asyncio.to_thread(
            read_lines, data, batch.doc["endpoint"], self.settings.max_lines
        )
        if not errors:
            self._lines = lines
        return lines, errors

    async def _validate(self, batch: Batch) -> None:
        lines, errors = await self._read(batch)
        if errors:
            problems = json.dumps([e.as_dict() for e in errors[:_MAX_BATCH_ERRORS]])
            await self._move(B.FAILED, errors=problems)
        else:
            await self._move(B.IN_PROGRESS, total=len(lines))

    async def _run_lines(self, batch: Batch) -> None:
        lines, errors = await self._read(batch)
        if errors:  # its input was deleted under it: it fails, with what ended kept
            await self._end_files(batch, B.FAILED, "", "", errors=json.dumps([errors[0].as_dict()]))
            return
        ends, sent = await self.store.ends(self.id), await self.store.sent(self.id)
        todo = iter([line for line in run_order(lines) if line.index not in ends])
        count = min(self.settings.concurrency, len(lines) - len(ends))
        if time.time() >= batch.expires_at:  # taken up past its window: nothing more is sent
            count = 0
        tasks = {asyncio.create_task(self._lines_of(batch, todo, sent)) for _ in range(count)}
        self._cancel_jobs = False
        try:
            while tasks:
                done, tasks = await asyncio.wait(tasks, timeout=LOOK_S)
                for task in done:
                    task.result()  # LeaseLost, or Redis failing: this driver stops
                if tasks and await self._must_stop(batch):
                    self._cancel_jobs = True  # cancelled, or past its window: stop its jobs
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if time.time() >= batch.expires_at:
            await self._cancel_in_flight()
            await self._end_files(batch, B.EXPIRED, "batch_expired", "the completion window ended")
        elif not self._cancel_jobs:
            await self._move(B.FINALIZING)

    async def _must_stop(self, batch: Batch) -> bool:
        if time.time() >= batch.expires_at:
            return True
        return (await self.store.get(self.id)).state is not B.IN_PROGRESS

    async def _lines_of(self, batch: Batch, todo: Iterator[Line], sent: dict[int, str]) -> None:
        for line in todo:  # the lines' tasks share one iterator: each line is run once
            await self._run_line(batch, line, sent.get(line.index))

    async def _run_line(self, batch: Batch, line: Line, sent: str | None) -> None:
        endpoint = batch.doc["endpoint"]
        job_id = f"{self.id}-{line.index}"
        status, body = 200, None
        try:
            spec = job_of(endpoint, line.body)
            extra = {**spec.pop("extra"), "tenant": batch.tenant, "weight": batch.doc["weight"]}
            model = self.first_name(spec.pop("model"))
            spec.update(model=model, extra=extra, priority="batch", id=job_id)
            job = await self._send(line, spec, sent, batch.expires_at)
            try:
                # past the window the batch's look stops the job: the wait outlasts it
                final = await job.final(batch.expires_at - time.time() + 10 * LOOK_S)
            except asyncio.CancelledError:
                if self._cancel_jobs:
                    await asyncio.shield(job.cancel())
                raise
            body = answer_of(endpoint, line.body, job_id, final)
        except (RedisUnavailable, LeaseLost, *REDIS_AWAY):
            raise  # not the line's outcome: this driver stops, the next one waits for the job
        except Exception as exc:  # the line's own, or a record of it this gateway cannot read
            status, body = line_error(exc, job_id)
        answer = json.dumps(output_line(line, job_id, status, body)).encode()
        place = await self._keep(answer)
        counter = "completed" if status == 200 else "failed"
        value = f"{status}|{place}"  # Redis keeps where the answer is, not the answer
        written, _ = await self.store.write_end(self.id, self.holder, line.index, value, counter)
        if written is Written.LEASE:
            raise LeaseLost(self.id)

    async def _keep(self, answer: bytes) -> str:
        """The answer appended to this driver's spool; a disk that refuses it (full, read
        only) is asked again, then the driver stops (the next one waits for the job)."""
        return await self._again(
            partial(asyncio.to_thread, self.spool.append, answer), (OSError,), "keeping an answer"
        )

    async def _send(
        self, line: Line, spec: dict[str, Any], sent: str | None, deadline: float
    ) -> AsyncJob:
        """The line's job. Its time is written down before it is sent, and its id is
        claimed (with that time) as it is sent: a job whose id is claimed is waited for,
        never sent again (its reader sends it to placement again if it was lost on the
        way, and placement places a job once); one not claimed is sent. A pool with no
        worker or no room now is asked again."""
        if sent is None:  # none yet, or Redis lost it and kept the claim: that time
            claimed = await self.client.r.get(keys.job_submitted(spec["id"]))
            at = text(claimed) if claimed else repr(time.time())
            written, sent = await self.store.write_sent(self.id, self.holder, line.index, at)
            if written is Written.LEASE:
                raise LeaseLost(self.id)
        busy = (NoWorkers, ServerBusy, RedisUnavailable)
        send = partial(self._send_once, spec, sent)
        return await self._again(send, busy, f"sending {spec['id']}", deadline)

    async def _send_once(self, spec: dict[str, Any], sent: str) -> AsyncJob:
        r, job_id = self.client.r, spec["id"]
        if await r.exists(keys.job_submitted(job_id)):
            return self.client.attach(**spec, submitted_at=float(sent))
        # shielded: a driver that stops (its lease lost, Redis gone) while a line is being
        # sent must let the send finish and the job live (the next driver waits for it);
        # the client would cancel the job of a caller that left
        sending = asyncio.ensure_future(self.client.submit(**spec, submitted_at=float(sent)))
        sending.add_done_callback(_retrieved)
        try:
            return await asyncio.shield(sending)
        except InvalidRequest:
            # claimed meanwhile by a driver that lost its lease sending it with the same time,
            # or placed with its claim gone (its custody record refuses): this line's job
            claimed = await r.get(keys.job_submitted(job_id))
            if claimed == sent.encode() or not claimed and await r.exists(keys.job_custody(job_id)):
                return self.client.attach(**spec, submitted_at=float(sent))
            raise

    async def _again(
        self,
        attempt: Callable[[], Awaitable[T]],
        passing: tuple[type[Exception], ...],
        what: str,
        deadline: float = math.inf,
    ) -> T:
        """``attempt``'s answer, asked again after each of ``passing``'s errors (waits of
        _RETRY_S) while the deadline allows; the last try's error is the caller's."""
        for wait in _RETRY_S:
            try:
                return await attempt()
            except passing as exc:
                if time.time() + wait >= deadline:
                    raise
                log.warning("batch %s: %s failed (%s); again in %g s", self.id, what, exc, wait)
                await asyncio.sleep(wait)
        return await attempt()

    async def _finalize(self, batch: Batch) -> None:
        _, errors = await self._read(batch)
        if errors:
            await self._end_files(batch, B.FAILED, "", "", errors=json.dumps([errors[0].as_dict()]))
        else:
            await self._end_files(batch, B.COMPLETED, "", "")

    async def _cancel(self, batch: Batch) -> None:
        await self._cancel_in_flight()
        await self._end_files(batch, B.CANCELLED, "batch_cancelled", "the batch was cancelled")

    async def _cancel_in_flight(self) -> None:
        """Cancel the lines' jobs sent and not ended (again, after a driver died)."""
        ends, sent = await self.store.ends(self.id), await self.store.sent(self.id)
        for index in set(sent) - set(ends):
            await self.client.cancel(f"{self.id}-{index}")

    async def _end_files(
        self, batch: Batch, target: BatchState, code: str, why: str, **fields: Any
    ) -> None:
        """Write the output and error files, then end the batch in ``target`` with them.
        The files are this driver's own: a driver whose move is refused deletes them."""
        lines, _ = await self._read(batch)
        ends = await self.store.ends(self.id)
        ids, counts = await asyncio.to_thread(self._write_files, batch, lines, ends, code, why)
        moved, _ = await self.store.move(
            self.id, target, Mover.DRIVER, self.holder, **counts, **ids, **fields
        )
        if moved is not Moved.MOVED:  # another driver's files stand (or a cancel came)
            for file_id in ids.values():
                with contextlib.suppress(NotFound):
                    await asyncio.to_thread(self.files.delete, file_id, None)
        if moved is Moved.LEASE:
            raise LeaseLost(self.id)
        if moved is Moved.MOVED:
            await asyncio.to_thread(spool.remove, self.files.root.parent, self.id)

    def _write_files(
        self, batch: Batch, lines: list[Line], ends: dict[int, str], code: str, why: str
    ) -> tuple[dict[str, str], dict[str, int]]:
        """The output file (answers) and the error file (failed requests, and lines that
        never ended, as ``code``), lines in input order, read from the spools one by one;
        their ids and the batch's counts. Blocking."""
        root = self.files.root.parent
        answers = {index: _answer_of(value) for index, value in ends.items()}
        ok = [i for i in sorted(answers) if answers[i][0] == 200]
        failed = sorted((set(answers) | {line.index for line in lines}) - set(ok))
        lost: set[int] = set()  # answers this process cannot read back (a data dir not shared)

        def rows(indexes: list[int]) -> Iterator[bytes]:
            for index in indexes:
                if index not in answers:
                    yield json.dumps(unrun_line(lines[index], code, why)).encode()
                    continue
                data = None if index in lost else spool.read(root, answers[index][1])
                if data is not None:
                    yield data
                elif indexes is ok:
                    lost.add(index)  # to the error file
                else:
                    yield json.dumps(lost_line(lines, index)).encode()

        ids: dict[str, str] = {}
        mine = uuid.uuid4().hex[:8]
        for name in ("output", "error"):
            if name == "error":
                failed = sorted(set(failed) | lost)
            indexes = ok if name == "output" else failed
            if not indexes:
                continue
            file_id = f"file-{self.id.removeprefix('batch_')}-{name}-{mine}"
            filename, keep_s = f"{self.id}_{name}.jsonl", self.settings.retention_s
            made = (rows(indexes), filename, "batch_output", batch.tenant, keep_s, file_id)
            if self.files.create(*made)["bytes"] == 0:  # every answer in it was lost
                self.files.delete(file_id, None)
                continue
            ids[f"{name}_file_id"] = file_id
        return ids, {"completed": len(ok) - len(lost), "failed": len(failed)}


def _answer_of(end: str) -> tuple[int, str]:
    """A line's end as written (``status|place``): its status and where its answer is."""
    status, _, place = end.partition("|")
    return int(status), place


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a send's outcome read (its driver may have stopped waiting for it)."""
    if not task.cancelled():
        task.exception()

"""Batches: many prompts (or chats) through one model, bounded in flight, rows in input order.

The caller's thread drives everything: it submits up to ``concurrency`` jobs, notices
finished ones through their Celery result keys (a subscription to their result channels
wakes it, one pipelined GET tells which are done), and writes each row once every earlier
row is written. No thread per job, so Ctrl-C lands where the in-flight jobs can be
cancelled and the output file is left whole for ``resume``.
"""

from __future__ import annotations

import heapq
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol, cast

import redis
from celery import Celery

from api_client.batch_files import (
    BatchInput,
    BatchSummary,
    Row,
    check_output,
    finished_ids,
    read_rows,
    result_row,
)
from api_client.results import result_key, result_ready
from scheduler.errors import (
    GgufqError,
    InvalidModelFile,
    InvalidRequest,
    JobFailed,
    JobLost,
    JobTimeout,
    LoadFailed,
    ModelNotFound,
    NoWorkers,
    RedisUnavailable,
    ServerBusy,
)
from scheduler.names import check_model_name
from scheduler.protocol import GenerateResponse, Options
from scheduler.store.chunk_reading import ChunkSources
from scheduler.store.streams import progress

RETRY_BACKOFF_S = 0.5  # first retry after this, doubling per attempt
RETRY_BACKOFF_MAX_S = 10.0
WINDOW_PER_SLOT = 32  # rows submitted ahead of the oldest unwritten one, per unit of concurrency
_WAKE_S = 0.5  # the longest the loop sleeps without looking at its jobs


class SubmittedJob(Protocol):
    """What a batch needs of a submitted job (``Job`` is one)."""

    @property
    def id(self) -> str: ...

    def final(self, timeout: float | None = None) -> dict[str, Any]: ...

    def cancel(self) -> None: ...


class Submitter(Protocol):
    """What a batch needs of its client (``Client`` is one): a way to submit jobs, and the
    Redis and Celery app their results are stored in."""

    @property
    def r(self) -> redis.Redis: ...

    @property
    def streams(self) -> ChunkSources: ...

    @property
    def app(self) -> Celery: ...

    @property
    def timeout(self) -> float: ...

    def submit(
        self,
        model: str,
        prompt: str = "",
        *,
        options: dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        priority: Literal["interactive", "batch"] = "interactive",
        extra: dict[str, Any] | None = None,
    ) -> SubmittedJob: ...


@dataclass
class _InFlight:
    position: int  # in the rows left to run
    row: Row
    job: SubmittedJob
    attempt: int
    deadline: float
    chunks_seen: int = 0


class BatchStopped(Exception):
    """The batch was asked to stop (its awaiting task was cancelled)."""


def is_transient(exc: GgufqError) -> bool:
    """Errors that another attempt may not meet: no capacity or workers right now, a lost
    worker, a job Redis lost, a load that failed, a job that made no progress for the
    client's timeout."""
    if isinstance(exc, NoWorkers | ServerBusy | JobTimeout | LoadFailed | JobLost):
        return True
    return isinstance(exc, JobFailed) and " was lost: " in exc.message


class BatchRun:
    """One call of :meth:`Client.batch`; see :func:`run_batch`."""

    def __init__(
        self,
        client: Submitter,
        model: str,
        rows: list[Row],
        *,
        output: Path | None,
        concurrency: int,
        priority: Literal["interactive", "batch"],
        options: dict[str, Any],
        keep_alive: str | float | None,
        resume: bool,
        retries: int,
        on_progress: Callable[[BatchSummary], object] | None,
        stop: threading.Event | None = None,
    ) -> None:
        if concurrency < 1:
            raise InvalidRequest(f"concurrency must be at least 1, got {concurrency}")
        if retries < 0:
            raise InvalidRequest(f"retries must be 0 or more, got {retries}")
        if resume and output is None:
            raise InvalidRequest("resume=True needs an output file to resume from")
        if output is not None:
            check_output(output)
        self.client = client
        self.model = model
        self.output = output
        self.concurrency = concurrency
        self.priority = priority
        self.options = options
        self.keep_alive = keep_alive
        self.retries = retries
        self.resume = resume
        self.on_progress = on_progress
        self.stop = stop
        done_ids = finished_ids(output) if resume and output is not None else set()
        self.todo = [row for row in rows if str(row.id) not in done_ids]
        self.summary = BatchSummary(
            total=len(rows),
            skipped=len(rows) - len(self.todo),
            output=None if output is None else str(output),
        )
        self.window = concurrency * WINDOW_PER_SLOT
        self.next_new = 0  # the next row of todo never submitted
        self.next_write = 0  # the next row of todo to write
        self.in_flight: dict[str, _InFlight] = {}
        self.retry_at: list[tuple[float, int, int]] = []  # (when, todo position, attempt)
        self.results: dict[int, dict[str, Any]] = {}  # finished rows waiting for earlier ones
        self.pubsub = client.r.pubsub(ignore_subscribe_messages=True)
        self.started = time.monotonic()

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> BatchSummary:
        file: IO[str] | None = None
        if self.stop is not None and self.stop.is_set():  # before the output is touched
            raise BatchStopped("stopped before the first row")
        if self.output is not None:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            file = self.output.open("a" if self.resume else "w", encoding="utf-8")
        try:
            self._report()
            while self.next_write < len(self.todo):
                if self.stop is not None and self.stop.is_set():
                    raise BatchStopped(f"stopped with {self.summary.finished} rows written")
                self._submit_due()
                self._collect()
                self._write(file)
                if self.next_write < len(self.todo):
                    self._wait()
            return self.summary
        except BaseException:
            self._cancel_in_flight()
            raise
        finally:
            self.pubsub.close()
            if file is not None:
                file.close()

    def _submit_due(self) -> None:
        now = time.monotonic()
        while self.retry_at and self.retry_at[0][0] <= now and self._room():
            _, position, attempt = heapq.heappop(self.retry_at)
            self._submit(position, attempt)
        while (
            self.next_new < len(self.todo)
            and self._room()
            and self.next_new - self.next_write < self.window
        ):
            self.next_new += 1
            self._submit(self.next_new - 1, 0)

    def _room(self) -> bool:
        return len(self.in_flight) < self.concurrency

    def _submit(self, position: int, attempt: int) -> None:
        row = self.todo[position]
        if row.problem:
            self._finish(position, None, InvalidRequest(f"row {row.id!r}: {row.problem}"))
            return
        extra = None if row.messages is None else {"kind": "chat", "messages": row.messages}
        try:
            job = self.client.submit(
                self.model,
                row.prompt or "",
                options={**self.options, **row.options},
                keep_alive=self.keep_alive,
                priority=self.priority,
                extra=extra,
            )
        except GgufqError as exc:
            self._failed(position, attempt, exc)
            return
        self.pubsub.subscribe(result_key(self.client.app, job.id))
        deadline = time.monotonic() + self.client.timeout
        self.in_flight[job.id] = _InFlight(position, row, job, attempt, deadline)

    def _collect(self) -> None:
        if not self.in_flight:
            return
        app = self.client.app
        flights = list(self.in_flight.values())
        raws = self.client.r.mget([result_key(app, f.job.id) for f in flights])
        now = time.monotonic()
        for flight, raw in zip(flights, cast(list[bytes | None], raws), strict=True):
            if result_ready(app, raw):
                self._settle(flight)
            elif now >= flight.deadline:
                self._check_stalled(flight, now)

    def _settle(self, flight: _InFlight) -> None:
        self._forget(flight)
        try:
            final = flight.job.final(timeout=self.client.timeout)
        except GgufqError as exc:
            self._failed(flight.position, flight.attempt, exc)
            return
        self._finish(flight.position, GenerateResponse.model_validate(final), None)

    def _check_stalled(self, flight: _InFlight, now: float) -> None:
        """Past its deadline: fine while chunks keep coming, else it timed out."""
        chunks, _ = progress(self.client.streams.of(flight.job.id)[0], flight.job.id)
        if chunks > flight.chunks_seen:
            flight.chunks_seen = chunks
            flight.deadline = now + self.client.timeout
            return
        self._forget(flight)
        flight.job.cancel()
        error = JobTimeout(
            f"job {flight.job.id} (row {flight.row.id!r}) made no progress for "
            f"{self.client.timeout:.0f} s; it was cancelled"
        )
        self._failed(flight.position, flight.attempt, error)

    def _failed(self, position: int, attempt: int, exc: GgufqError) -> None:
        if isinstance(exc, ModelNotFound | InvalidModelFile | RedisUnavailable):
            raise exc  # about the model or the cluster, not the row: every other row would fail
            # the same way (the rows already written stay: --resume goes on from them)
        if is_transient(exc) and attempt < self.retries:
            delay = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2**attempt)
            heapq.heappush(self.retry_at, (time.monotonic() + delay, position, attempt + 1))
            return
        self._finish(position, None, exc)

    def _finish(
        self, position: int, result: GenerateResponse | None, error: GgufqError | None
    ) -> None:
        out = result_row(self.todo[position], result, error)
        self.results[position] = out

    def _write(self, file: IO[str] | None) -> None:
        while self.next_write in self.results:
            out = self.results.pop(self.next_write)
            if file is not None:
                file.write(json.dumps(out, ensure_ascii=False) + "\n")
                file.flush()
            else:
                self.summary.rows.append(out)
            self.next_write += 1
            if out["error"] is None:
                self.summary.done += 1
                self.summary.tokens += out["stats"]["eval_count"] or 0
            else:
                self.summary.failed += 1
                self.summary.first_error = self.summary.first_error or out["error"]["message"]
            self._report()

    def _wait(self) -> None:
        """Sleep until a result is stored (its channel wakes us) or a retry is due."""
        timeout = _WAKE_S
        if self.retry_at:
            timeout = min(timeout, max(0.0, self.retry_at[0][0] - time.monotonic()))
        if self.in_flight and timeout > 0:
            message = self.pubsub.get_message(timeout=timeout)
            while message is not None:  # drain: one look at all jobs covers them
                message = self.pubsub.get_message(timeout=0)
        elif timeout > 0:
            time.sleep(timeout)

    # -- helpers ---------------------------------------------------------------------------
    def _report(self) -> None:
        self.summary.seconds = time.monotonic() - self.started
        if self.on_progress is not None:
            self.on_progress(self.summary)

    def _forget(self, flight: _InFlight) -> None:
        del self.in_flight[flight.job.id]
        self.pubsub.unsubscribe(result_key(self.client.app, flight.job.id))

    def _cancel_in_flight(self) -> None:
        for flight in list(self.in_flight.values()):
            try:
                flight.job.cancel()
            except Exception:  # best effort on the way out; the error being raised matters
                pass
        self.in_flight.clear()


def run_batch(
    client: Submitter,
    model: str,
    inputs: BatchInput,
    *,
    output: str | Path | None = None,
    concurrency: int = 8,
    priority: Literal["interactive", "batch"] = "batch",
    options: Options | dict[str, Any] | None = None,
    keep_alive: str | float | None = None,
    resume: bool = False,
    retries: int = 2,
    on_progress: Callable[[BatchSummary], object] | None = None,
    stop: threading.Event | None = None,
) -> BatchSummary:
    """Run every row of ``inputs`` through ``model``; returns the summary.

    ``inputs``: a list of prompts, a list of rows (``{"id", "prompt"}`` or ``{"id",
    "messages"}``, optional ``"options"`` merged over ``options``), or the path of a JSONL
    file of such rows. At most ``concurrency`` jobs are submitted and unfinished at once.
    Each row of ``output`` (JSONL, flushed row by row, in input order) has ``id``,
    ``input``, ``response``, ``stats`` and ``error`` (null or ``{code, message}``).
    ``resume=True`` keeps the rows already in ``output`` and runs only the others.
    Transient failures (no workers, server busy, a lost worker, a failed load, no progress
    for the client's timeout) are retried ``retries`` times with a doubling backoff; a row
    that still fails, or fails for good (an invalid option), gets its error and the batch
    goes on; a model that is not found or not usable stops the batch (ModelNotFound,
    InvalidModelFile), as every row would fail. ``on_progress(summary)`` is called once
    before the first job and after every row. Ctrl-C (KeyboardInterrupt) cancels the jobs
    in flight and leaves the rows written so far; run again with ``resume=True`` to finish.
    Setting ``stop`` does the same from another thread (raising BatchStopped).
    """
    check_model_name(model)
    if isinstance(options, Options):
        options = options.model_dump(exclude_unset=True)
    run = BatchRun(
        client,
        model,
        read_rows(inputs),
        output=None if output is None else Path(os.fspath(output)),
        concurrency=concurrency,
        priority=priority,
        options=dict(options or {}),
        keep_alive=keep_alive,
        resume=resume,
        retries=retries,
        on_progress=on_progress,
        stop=stop,
    )
    return run.run()

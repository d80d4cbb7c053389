"""The Python client: submit jobs, stream their chunks, read their results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Literal, overload

from api_client.batch import run_batch
from api_client.batch_files import BatchInput, BatchSummary
from api_client.batches.handle import BatchHandle, submit_batch
from api_client.job import Job
from scheduler.cluster import CustodyView, DeviceView, JobView, RunnerView, by_expiry
from scheduler.errors import NoWorkers, job_id_taken
from scheduler.gguf.registry import Registry
from scheduler.names import check_job_id, check_model_name
from scheduler.placement.needs import format_warning
from scheduler.placement.parking import ParkedJobs
from scheduler.protocol import (
    EmbedResponse,
    GenerateResponse,
    JobRequest,
    Message,
    Options,
    Placement,
)
from scheduler.protocol import parse_request as _parse
from scheduler.redis_urls import masked
from scheduler.settings import Settings, get_settings
from scheduler.store import keys
from scheduler.store.cancel import request_cancel
from scheduler.store.celery_app import ask_unload, close_app, make_app, run_message, send_job
from scheduler.store.chunk_reading import ChunkSources
from scheduler.store.connection import connect_typed, resolve_redis_url
from scheduler.store.headroom import admit, refused_for_memory
from scheduler.store.leases import LEASE_REPLY_S, ThreadLeases
from scheduler.store.readers import ClusterReader
from scheduler.store.routes import FastPath
from scheduler.store.scripts import script

_ALIVE_CACHE_S = 1.0
Messages = list[Message] | list[dict[str, Any]]


class Client:
    """Talks to a ggufq stack through its Redis.

    ``redis_url`` defaults to GGUFQ_REDIS_URL, else the local stack of `ggufq up`.
    ``timeout`` (seconds) bounds each wait for a chunk or a result. ``tenant`` names whom
    its jobs are for (fair shares: waiting jobs are served in turn across tenants, twice as
    often for ``weight`` 2); the gateway uses the API key's id.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        timeout: float = 300.0,
        settings: Settings | None = None,
        tenant: str = "default",
        weight: float = 1.0,
        max_connections: int | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.redis_url = redis_url or resolve_redis_url(self.settings)
        self.timeout = timeout
        self.tenant, self.weight = tenant, weight
        self.r = connect_typed(self.redis_url, max_connections)
        self.streams = ChunkSources(self.r, self.settings.stream_redis_urls, max_connections)
        self.leases = ThreadLeases(connect_typed(self.redis_url, socket_timeout=LEASE_REPLY_S))
        self.app = make_app(self.redis_url, self.settings)
        self.state = ClusterReader(self.r)
        self._alive_until = 0.0
        claim_ttl_s = int(max(self.settings.result_ttl_s, self.settings.stream_ttl_s))
        self._claim, self._claim_ttl_s = script(self.r, "claim_id"), claim_ttl_s
        self.fast = (
            FastPath(self.r, self.settings.device_ttl_s, claim_ttl_s, self.settings.stream_ttl_s)
            if self.settings.fast_path
            else None
        )

    def close(self) -> None:
        self.leases.close()
        self.streams.close()
        self.r.close()
        close_app(self.app)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------------
    def submit(
        self,
        model: str,
        prompt: str = "",
        *,
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        priority: Literal["interactive", "batch"] = "interactive",
        device: str | None = None,
        format: Literal["json"] | dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Job:
        """Submit a job and return its handle at once. ``format`` ("json" or a JSON schema)
        constrains the output through a grammar; ``extra`` and ``fields`` carry further
        request fields (``kind``, ``input``, ``truncate``; a chat's ``tools``,
        ``tool_choice``, ``parallel_tool_calls``)."""
        request = self.request(
            model,
            prompt,
            options=options,
            keep_alive=keep_alive,
            priority=priority,
            device=device,
            format=format,
            extra=extra,
            **fields,
        )
        with refused_for_memory():
            admit(self.r, request.chars)
            if not (self.fast is not None and self._send_fast(request)):
                self.send_to_placement(request)
        return Job(self, request)

    def request(
        self,
        model: str,
        prompt: str = "",
        *,
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        extra: dict[str, Any] | None = None,
        **fields: Any,
    ) -> JobRequest:
        """The job :meth:`submit` sends (its keyword arguments), checked (raises
        InvalidRequest), not sent."""
        check_model_name(model)
        if isinstance(options, Options):
            options = options.model_dump(exclude_unset=True)
        return _parse(
            {
                "model": model,
                "prompt": prompt,
                "options": options or {},
                "keep_alive_s": keep_alive,
                "priority": "interactive",
                "tenant": self.tenant,
                "weight": self.weight,
                **fields,
                **(extra or {}),
            }
        )

    def send_to_placement(self, request: JobRequest) -> None:
        """The normal path: claim the job's id and send it to placement (raises NoWorkers
        when nothing would serve it). The fast path checks its runner's device is alive
        itself: this look is for the jobs that take this path."""
        self._check_alive()
        self._claim_id(request)
        self.place(request)

    def fast_parts(
        self, request: JobRequest
    ) -> tuple[Callable[[Placement], tuple[str, str]], list[str]]:
        """What the fast path sends for ``request`` beside its route: its device queue and
        Celery message (made for a placement), and the job's warnings."""
        warning = format_warning(request)
        return partial(run_message, self.app, request), [warning] if warning else []

    def _send_fast(self, request: JobRequest) -> bool:
        """Send the job straight to its runner's queue when that is resident with a free
        slot (scheduler/store/routes.py); False when placement must place it."""
        assert self.fast is not None
        return self.fast.send(request, *self.fast_parts(request)) is not None

    def place(self, request: JobRequest) -> None:
        """Send a job to placement (again, when its message was lost: it places a job once)."""
        queue = keys.placement_queue(request.priority)
        send_job(self.app, keys.TASK_PLACE, request, f"{request.id}.place", queue)

    @overload
    def generate(
        self, model: str, prompt: str, *, stream: Literal[False] = False, **kw: Any
    ) -> GenerateResponse: ...

    @overload
    def generate(
        self, model: str, prompt: str, *, stream: Literal[True], **kw: Any
    ) -> Iterator[GenerateResponse]: ...

    def generate(
        self, model: str, prompt: str, *, stream: bool = False, **kw: Any
    ) -> GenerateResponse | Iterator[GenerateResponse]:
        """Generate a completion; with ``stream=True`` yield chunks, the last with the stats.

        Keyword arguments: ``options`` (dict or Options), ``keep_alive``, ``priority``.
        """
        job = self.submit(model, prompt, **kw)
        return job.stream() if stream else job.result()

    @overload
    def chat(
        self, model: str, messages: Messages, *, stream: Literal[False] = False, **kw: Any
    ) -> GenerateResponse: ...

    @overload
    def chat(
        self, model: str, messages: Messages, *, stream: Literal[True], **kw: Any
    ) -> Iterator[GenerateResponse]: ...

    def chat(
        self, model: str, messages: Messages, *, stream: bool = False, **kw: Any
    ) -> GenerateResponse | Iterator[GenerateResponse]:
        """Answer a conversation, rendered with the model's own chat template (from its GGUF
        metadata); the final record's ``message`` is the assistant's answer. Keyword
        arguments as for :meth:`generate`."""
        job = self.submit(model, extra={"kind": "chat", "messages": list(messages)}, **kw)
        return job.stream() if stream else job.result()

    def batch(
        self,
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
        """Run many prompts (or chats) with at most ``concurrency`` jobs in flight; rows
        come back in input order, written to ``output`` (JSONL) as they complete. See
        :func:`api_client.batch.run_batch` (``stop``, set from elsewhere, ends it as
        Ctrl-C does, raising BatchStopped)."""
        return run_batch(
            self,
            model,
            inputs,
            output=output,
            concurrency=concurrency,
            priority=priority,
            options=options,
            keep_alive=keep_alive,
            resume=resume,
            retries=retries,
            on_progress=on_progress,
            stop=stop,
        )

    def submit_batch(self, path: str | Path, **kw: Any) -> BatchHandle:
        """Start a batch on the cluster from a JSONL file of OpenAI Batch API lines (README:
        Batches on the cluster); it runs without this process. ``endpoint`` defaults to the
        first line's url; ``completion_window`` ("24h"), ``metadata``."""
        return submit_batch(self, path, **kw)

    def embed(
        self,
        model: str,
        input: str | list[str],
        *,
        truncate: bool = False,
        options: Options | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        timeout: float | None = None,
    ) -> EmbedResponse:
        """One L2-normalized vector per input (Ollama's /api/embed). An input longer than
        the context is refused (InvalidRequest) unless ``truncate``."""
        job = self.submit(
            model,
            options=options,
            keep_alive=keep_alive,
            extra={"kind": "embed", "input": input, "truncate": truncate},
        )
        return EmbedResponse.model_validate(job.final(timeout))

    def load(
        self,
        model: str,
        *,
        device: str | None = None,
        keep_alive: str | float | None = None,
        options: Options | dict[str, Any] | None = None,
        timeout: float | None = None,
        replicas: int = 0,
    ) -> GenerateResponse:
        """Load a model ahead of use (optionally on one device); returns once it is loaded.

        ``replicas`` loads copies of it on as many devices (where memory allows) and keeps
        them (keep_alive -1 unless given): a floor that bursts grow above, up to
        GGUFQ_MAX_REPLICAS, and shrink back to by keep_alive."""
        if replicas:
            keep_alive = -1 if keep_alive is None else keep_alive
        extra = {"replicas": replicas} if replicas else None
        jobs = [
            self.submit(
                model, "", options=options, keep_alive=keep_alive, device=device, extra=extra
            )
            for _ in range(max(1, replicas))
        ]
        return [job.result(timeout) for job in jobs][0]

    def unload(self, model: str) -> list[str]:
        """Unload every runner of ``model`` (a busy one when its last job ends).

        Returns the ids of the runners asked to unload.
        """
        check_model_name(model)
        asked = []
        devices = {d.id: d for d in self.devices()}
        for runner in self.ps():
            if runner.model != model:
                continue
            held = [d for d in runner.devices if d in devices]
            if held:
                ask_unload(self.app, devices[held[0]].worker, runner.id, when_idle=True)
            asked.append(runner.id)
        return asked

    def cancel(self, job_id: str) -> None:
        """Cancel a job by id (see :meth:`Job.cancel`); :class:`InvalidRequest` when
        ``job_id`` is not a job id. A job not placed yet is cancelled as it arrives."""
        request_cancel(self.r, check_job_id(job_id), self.settings.stream_ttl_s)

    def jobs(self) -> list[JobView]:
        """Jobs not ended yet: ``parked`` (waiting for memory; ``position`` in the order
        they will be retried, ``model_position`` among their model's), then ``queued`` at a
        worker (``position`` in their device's queue) and ``running``."""
        return ParkedJobs(self.r).listing() + self.state.sent_jobs()

    def custody(self, job_id: str) -> CustodyView | None:
        """Where a job is, as its custody record says: ``state`` (placing, parked, sent,
        running, orphaned, done, failed, cancelled), ``holder``, ``epoch`` (its moves) and
        ``moved_at``; None before placement takes it, or once its record expired."""
        return self.state.custody([job_id])[0]

    # -- state ------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """The models jobs can name (GGUFQ_MODELS_DIR as this process sees it, plus the demo
        model): name, path, GGUF metadata, or ``error`` saying why a file is unusable."""
        return Registry(self.settings.models_dir).described()

    def devices(self) -> list[DeviceView]:
        """Every registered device, with its memory (``free`` = min(reported free, total −
        reserved))."""
        return self.state.devices()

    def ps(self) -> list[RunnerView]:
        """Every runner (loaded model instance), Ollama's ``ps`` fields among ours, in its
        order: the longest time to expiry first."""
        return by_expiry(self.state.runners())

    def health(self) -> dict[str, Any]:
        """Live devices and placement services (two round trips: Redis's clock, the beats)."""
        devices, placement = self.state.alive_counts(self.settings.device_ttl_s)
        return {
            "redis": self.redis_url,
            "devices": devices,
            "placement": placement,
            "ok": devices > 0 and placement > 0,
        }

    def _claim_id(self, request: JobRequest) -> None:
        """A job id belongs to the job first submitted with it, while Redis knows that job:
        reusing one would read (or cancel) another job's stream and result."""
        claim = [keys.job_submitted(request.id), keys.job_custody(request.id)]
        if not self._claim(keys=claim, args=[request.submitted_at, self._claim_ttl_s]):
            raise job_id_taken(request.id)

    def _check_alive(self) -> None:
        now = time.monotonic()
        if now < self._alive_until:
            return
        health = self.health()
        if not health["placement"]:
            raise NoWorkers(
                f"no ggufq placement service is running for {masked(self.redis_url)}; start "
                "the stack with `ggufq up` (or `ggufq placement` beside your workers)"
            )
        if not health["devices"]:
            raise NoWorkers(
                f"no ggufq worker is running for {masked(self.redis_url)} (no device heartbeat "
                f"in the last {self.settings.device_ttl_s:.0f} s); start one with `ggufq up` or "
                "`ggufq worker`"
            )
        self._alive_until = now + _ALIVE_CACHE_S

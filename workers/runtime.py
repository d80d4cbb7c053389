"""What one worker process does: own its devices, keep runners resident, run jobs.

Celery delivers jobs to this process's device queue; this module turns each into chunks
on the job's stream, a final result, and up-to-date runner state in Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from scheduler.cluster import DeviceInfo
from scheduler.errors import GgufqError, InvalidModelFile, JobCancelled, JobFailed, LoadFailed
from scheduler.gguf.metadata import read_model_info
from scheduler.gguf.registry import Registry
from scheduler.placement.metrics import count
from scheduler.protocol import JobRequest, Placement, SentJob, parse_placement, parse_request
from scheduler.settings import Settings
from scheduler.store.cancel import CancelWatcher, cancelled_before_start
from scheduler.store.streams import error_chunk
from scheduler.store.worker_state import WorkerState
from workers.chat import render
from workers.chunks import ChunkPublisher, ChunkWriter
from workers.devices import reported_free, tensor_split, wait_for_release
from workers.embedder import Embedder
from workers.keepalive import ExpirySchedule, effective_keep_alive, expires_at
from workers.runner import Runner

log = logging.getLogger(__name__)
Clock = Callable[[], float]
Progress = Callable[..., None]


def _silent(state: str, **fields: Any) -> None:
    pass


class Ticker:
    """Publishes each piece of text and reports GENERATING with the count so far, at most
    once every ``every_s`` seconds (pieces are tokens, but for multi-byte characters)."""

    def __init__(
        self,
        progress: Progress,
        publish: Callable[[str], None],
        every_s: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.progress, self.publish, self.every_s, self.clock = progress, publish, every_s, clock
        self.count = 0
        self.next_at = clock()

    def __call__(self, text: str) -> None:
        self.publish(text)
        self.count += 1
        now = self.clock()
        if now >= self.next_at:
            self.next_at = now + self.every_s
            self.progress("generating", tokens=self.count)


AnyRunner = Runner | Embedder


class NotOwned(Exception):
    """A delivered job that is no longer this device's: drop it without a result."""


class HandBack(NotOwned):
    """This device could not load the job's model: placement places the job again."""


class WorkerRuntime:
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        devices: list[DeviceInfo],
        registry: Registry,
        clock: Clock = time.time,
    ) -> None:
        self.settings = settings
        self.r = client
        self.state = WorkerState(client)
        self.devices = devices
        self.registry = registry
        self.clock = clock
        self.runners: dict[str, AnyRunner] = {}
        self._load_lock = threading.Lock()
        self._expiry = ExpirySchedule()
        self._wake = threading.Condition()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.chunks = ChunkWriter(client, settings.helper_nice, settings.stream_interval_s)
        self.cancels = CancelWatcher(client)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        now = self.clock()
        for dev in self.devices:
            self.state.register_device(dev, now)
        self.cancels.start()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._expiry_loop, "expiry")):
            thread = threading.Thread(target=target, name=f"ggufq-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("serving devices %s", ", ".join(d.id for d in self.devices))

    def stop(self) -> None:
        self._stopping.set()
        self.cancels.stop()
        with self._wake:
            self._wake.notify_all()
        for runner_id in list(self.runners):
            self._unload(runner_id, force=True)
        self.state.deregister_devices([d.id for d in self.devices])
        self.chunks.close()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_interval_s):
            try:
                self.state.heartbeat(reported_free(self.devices), self.clock())
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _expiry_loop(self) -> None:
        while not self._stopping.is_set():
            with self._wake:
                due = self._expiry.pop_due(self.clock())
                if not due:
                    next_at = self._expiry.next_at()
                    timeout = 1.0 if next_at is None else max(0.0, next_at - self.clock())
                    self._wake.wait(min(timeout, 1.0))
                    continue
            for runner_id in due:
                self._unload(runner_id)

    def _schedule_expiry(self, runner_id: str, at: float | None) -> None:
        with self._wake:
            self._expiry.set(runner_id, at)
            self._wake.notify_all()

    # -- jobs -----------------------------------------------------------------------------
    def run_job(
        self, job: dict[str, Any], sent: dict[str, Any], progress: Progress = _silent
    ) -> dict[str, Any]:
        """Run one job to its end; returns the final record, raises a GgufqError on failure.

        ``progress(state, **fields)`` hears of LOADING and GENERATING (with a token count,
        at most once a second): Flower shows them as the task's state."""
        received = time.perf_counter_ns()
        req = parse_request(job)
        placement = parse_placement(sent)
        if not self.state.owns(placement.device_id, req.id, placement.id):
            # the device was dropped meanwhile (this worker was stopped or lost its Redis
            # connection) and placement re-placed or failed the job
            raise NotOwned(req.id)
        runner_id = placement.runner_id
        publisher = ChunkPublisher(self.r, req.id, self.settings.stream_ttl_s, self.chunks)
        base = {"model": req.model, "job_id": req.id, "device": placement.device_id}
        keep_alive = self.settings.keep_alive_s
        cancelled = self.cancels.watch(req.id)
        tally: dict[str, float] = {}  # the job's counters (scheduler/placement/metrics.py)
        try:
            if cancelled():
                raise cancelled_before_start(req.id)  # while it waited in the queue
            self.state.started(req.id, self.clock())
            if runner_id not in self.runners:
                progress("loading", device=placement.device_id)
            runner, load_ns = self._runner_for(req, placement)
            keep_alive = effective_keep_alive(req.keep_alive_s, runner.keep_alive_s)
            runner.keep_alive_s = keep_alive
            self._schedule_expiry(runner_id, None)
            final: dict[str, Any] = dict(
                base, created_at=self.clock(), done=True, load_duration=load_ns
            )
            warnings = list(placement.warnings)
            if req.kind == "embed":
                final.update(_embed(req, runner))
            elif req.kind == "chat":
                prompt = self._chat_prompt(req, warnings)
                final.update(_generate(req, runner, publisher, cancelled, prompt, progress))
                final["message"] = {"role": "assistant", "content": final["response"]}
            elif req.prompt == "":
                final.update(response="", done_reason="load" if keep_alive != 0 else "unload")
            else:
                final.update(_generate(req, runner, publisher, cancelled, req.prompt, progress))
            if warnings:
                final["warnings"] = warnings
            final["total_duration"] = time.perf_counter_ns() - received + placement.placement_ns
            # vectors travel in the result only: the stream's final chunk has the stats
            publisher.publish({k: v for k, v in final.items() if k != "embeddings"})
            publisher.flush()  # the stream is complete before the result is stored
            tally = {
                "finished": 1,
                "tokens": final.get("eval_count") or 0,
                "prompt_tokens": final.get("prompt_eval_count") or 0,
            }
            return final
        except HandBack as exc:
            log.warning("handing job %s back to placement: %s", req.id, exc)
            self.state.hand_back(
                SentJob(
                    job=req,
                    placement=placement,
                    worker=self.worker_name,
                    avoid=[placement.device_id],
                )
            )
            raise
        except GgufqError as exc:
            publisher.publish(error_chunk(req.model, req.id, exc, device=base["device"]))
            publisher.flush()
            tally = {"cancelled" if isinstance(exc, JobCancelled) else "failed": 1}
            raise
        except Exception as exc:
            log.exception("job %s failed", req.id)
            error = JobFailed(f"job {req.id} failed on {placement.device_id}: {exc}")
            publisher.publish(error_chunk(req.model, req.id, error, device=base["device"]))
            publisher.flush()
            tally = {"failed": 1}
            raise error from None
        finally:
            pipe = self.r.pipeline(transaction=False)  # one round trip for the bookkeeping
            self.state.done_with(placement.device_id, req.id, placement.id, pipe)
            count(pipe, req.model, **tally)
            pipe.execute()
            self.cancels.forget(req.id)
            self._job_ended(runner_id, keep_alive)

    def _chat_prompt(self, req: JobRequest, warnings: list[str]) -> str:
        info = read_model_info(self.registry.resolve(req.model))
        if not info.chat_template:
            warnings.append(
                f"model {req.model!r} has no chat template in its metadata; the messages were "
                "rendered as a plain 'Role: text' transcript"
            )
        messages = [m.model_dump() for m in req.messages]
        return render(info.chat_template, messages, info.bos_text, info.eos_text, req.model)

    def _job_ended(self, runner_id: str, keep_alive_s: float) -> None:
        now = self.clock()
        left = self.state.finish(runner_id, now, keep_alive_s)
        self.state.announce({"event": "job_finished", "runner": runner_id, "in_flight": left})
        if left == 0 and runner_id not in self.runners:
            # never loaded (its only job was cancelled in the queue, or the load failed):
            # nothing will expire it, so release its reservation now
            self._unload(runner_id)
        elif left == 0:
            if keep_alive_s == 0:
                self._unload(runner_id)
            else:
                self._schedule_expiry(runner_id, expires_at(now, keep_alive_s))

    def _runner_for(self, req: JobRequest, placement: Placement) -> tuple[AnyRunner, int]:
        runner_id = placement.runner_id
        with self._load_lock:
            runner = self.runners.get(runner_id)
            if runner is not None:
                return runner, 0
            if not self.state.runner_exists(runner_id):
                raise LoadFailed(
                    f"the runner for {req.model!r} on {placement.device_id} was unloaded "
                    "before this job reached it (its load failed or it expired); "
                    "submit the job again"
                )
            runner = self._load(req, placement)
            self.runners[runner_id] = runner
        self.state.update_runner(
            runner_id, {"state": "ready", "loaded_at": self.clock(), "worker": self.worker_name}
        )
        pipe = self.r.pipeline(transaction=False)
        count(pipe, req.model, loads=1, load_seconds=runner.load_duration_ns / 1e9)
        pipe.execute()
        return runner, runner.load_duration_ns

    def _load(self, req: JobRequest, placement: Placement) -> AnyRunner:
        runner_id = placement.runner_id
        try:
            path = self.registry.resolve(req.model)
            info = read_model_info(path)  # a clear error for a bad file before llama.cpp
            config = placement.config
            common: dict[str, Any] = {
                "n_gpu_layers": placement.n_gpu_layers,
                "n_threads": self.settings.cpu_threads or None,
                "keep_alive_s": effective_keep_alive(req.keep_alive_s, self.settings.keep_alive_s),
            }
            args = (runner_id, req.model, str(path), config, placement.devices)
            if config.embedding:
                return Embedder(*args, **common, pooling_type=info.pooling_type)
            split = tensor_split(placement.devices, placement.split_blocks)
            return Runner(*args, **common, load_timeout_s=self.settings.load_timeout_s, split=split)
        except (GgufqError, ValueError, RuntimeError, OSError) as exc:
            self._release(runner_id, placement.devices)
            if isinstance(exc, InvalidModelFile | LoadFailed):
                raise
            device = placement.device_id
            if req.attempt == 0 and not device.startswith("cpu:"):
                # perhaps out of GPU memory (drivers and other processes take some):
                # placement tries once more, on another device
                raise HandBack(f"loading {req.model!r} on {device} failed: {exc}") from None
            raise LoadFailed(
                f"llama.cpp could not load model {req.model!r} on {device}"
                + (f" (nor on {', '.join(req.avoid)})" if req.avoid else "")
                + f" ({exc}); check that the file is a "
                "complete GGUF of an architecture this llama.cpp supports (`ggufq models`)"
            ) from None

    # -- unloading --------------------------------------------------------------------------
    def request_unload(self, runner_id: str, when_idle: bool = False) -> bool:
        """Unload a runner if it is idle (placement asks this to make room).

        With ``when_idle`` (``ggufq unload``) a busy runner unloads as its last job ends.
        """
        runner = self.runners.get(runner_id)
        if runner is None:
            return False
        if when_idle:
            runner.keep_alive_s = 0
        self._schedule_expiry(runner_id, None)
        return self._unload(runner_id)

    def _unload(self, runner_id: str, force: bool = False) -> bool:
        if not self.state.begin_unload(runner_id, force=force) and self.state.runner_exists(
            runner_id
        ):
            return False  # a job arrived meanwhile, or another unload is under way
        runner = self.runners.pop(runner_id, None)
        device_ids = runner.device_ids if runner else []
        if runner is not None:
            self._close(runner)
        self._release(runner_id, device_ids)
        log.info("unloaded runner %s", runner_id)
        return True

    def _close(self, runner: AnyRunner) -> None:
        """Free llama.cpp's memory; on NVIDIA GPUs wait (bounded) until the driver shows it."""
        gpus = [d for d in self.devices if d.kind == "gpu" and d.id in runner.device_ids]
        reserved = self.state.runner_devices(runner.id) if gpus else {}
        held = {d: n for d, n in reserved.items() if d in {g.id for g in gpus}}
        before = reported_free(gpus) if held else {}
        runner.close()
        wait = self.settings.unload_wait_s
        if not wait_for_release(lambda: reported_free(gpus), before, held, wait):
            log.warning(
                "the driver still shows runner %s's memory in use %.0f s after unloading; "
                "releasing its reservation anyway",
                runner.id,
                wait,
            )

    def _release(self, runner_id: str, device_ids: list[str]) -> None:
        held = device_ids or [d.id for d in self.devices]
        self.state.release(runner_id, held)

    @property
    def worker_name(self) -> str:
        return self.devices[0].worker if self.devices else ""


def _generate(
    req: JobRequest,
    runner: AnyRunner,
    publisher: ChunkPublisher,
    cancelled: Callable[[], bool],
    prompt: str,
    progress: Progress,
) -> dict[str, Any]:
    if not isinstance(runner, Runner):
        raise JobFailed(f"runner {runner.id} is loaded for embeddings; it cannot generate")
    ticker = Ticker(progress, lambda text: publisher.publish({"response": text}))
    stats = runner.generate(prompt, req.options, ticker, cancelled=cancelled, format=req.format)
    if stats.done_reason == "cancel":
        raise JobCancelled(f"job {req.id} was cancelled after {stats.eval_count} generated tokens")
    return stats.ollama_fields()


def _embed(req: JobRequest, runner: AnyRunner) -> dict[str, Any]:
    if not isinstance(runner, Embedder):
        raise JobFailed(f"runner {runner.id} is loaded for generation; it cannot embed")
    stats = runner.embed(req.input, req.truncate)
    return {
        "embeddings": stats.embeddings,
        "prompt_eval_count": stats.prompt_eval_count,
        "done_reason": "stop",
    }

"""What one worker process does: own its devices, keep runners resident, run jobs.

Celery delivers jobs to this process's device queue; this module turns each into chunks
on the job's stream, a final result, and up-to-date runner state in Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import redis

from scheduler.cluster import DeviceInfo
from scheduler.errors import GgufqError, JobCancelled, JobFailed
from scheduler.gguf.registry import Registry
from scheduler.loops import LoopHealth, start_loop
from scheduler.protocol import JobRequest, Placement, SentJob, parse_placement, parse_request
from scheduler.settings import Settings
from scheduler.store.cancel import CancelWatcher, cancelled_before_start
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.hops import note as note_hops
from scheduler.store.stats import count, execute, job_timings, observe
from scheduler.store.streams import Appended, error_chunk
from workers.chunks import ChunkWriter
from workers.generation import AnyRunner, Progress, produce
from workers.handback import HandBack, NotOwned, stopped_run
from workers.keepalive import expires_at
from workers.membership import Membership
from workers.publisher import ChunkPublisher
from workers.residency import Clock, Residency
from workers.start_claim import StartClaim
from workers.strays import Strays

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


def _silent(state: str, **fields: Any) -> None:
    pass


def finished_tally(final: dict[str, Any]) -> dict[str, float]:
    """A finished job's counters (scheduler/placement/metrics.py)."""
    tokens, prompt_tokens = final.get("eval_count") or 0, final.get("prompt_eval_count") or 0
    return {"finished": 1, "tokens": tokens, "prompt_tokens": prompt_tokens}


def failed_tally(error: GgufqError) -> dict[str, float]:
    return {"cancelled" if isinstance(error, JobCancelled) else "failed": 1}


class WorkerRuntime(Residency):
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        devices: list[DeviceInfo],
        registry: Registry,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(settings, client, devices, registry, clock)
        # runs (job id, placement id) placement took back, or whose chunks were fenced off:
        # they stop and write nothing
        self._disowned: set[tuple[str, str]] = set()
        # runs whose end is being written (out of _running, their record still in Redis)
        self._ending: set[tuple[str, str]] = set()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.health = LoopHealth()
        self.chunks = ChunkWriter(
            self.streams, settings.helper_nice, settings.stream_interval_s, on_fenced=self._fenced
        )
        self.cancels = CancelWatcher(client, self.health)
        self.membership = Membership(self.state, devices, self.health, settings, self._let_go)
        self.strays = Strays(
            self.state,
            [d.id for d in devices],
            self._runs,
            lambda: len(self.backlog) > 0,
            self._write_end,
            min_age_s=max(10.0, 4 * settings.heartbeat_interval_s),
        )

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.membership.join()
        self.cancels.start()
        every = self.settings.heartbeat_interval_s
        redis_away = REDIS_AWAY  # else a Redis error (out of memory, read-only) is logged whole
        for name, step, every_s in (
            ("heartbeat", self._beat, every),
            ("expiry", self._expire_due, 0.0),
            ("strays", lambda: (self.strays.look(), self.mark_loaded_ready()), 2 * every),
        ):
            loop = start_loop(name, step, self._stopping, self.health, every_s, redis_away)
            self._threads.append(loop)
        log.info("serving devices %s", ", ".join(d.id for d in self.devices))

    def stop(self) -> None:
        self._stopping.set()
        self.cancels.stop()
        with self._wake:
            self._wake.notify_all()
        for runner_id in list(self.runners):
            self._unload(runner_id, force=True)
        self.membership.leave()
        self.chunks.close()

    def _beat(self) -> None:
        self.membership.beat()  # first the heartbeat: a slow unload below must not delay it
        self.backlog.drain()  # then the job ends an outage held back

    def _let_go(self, gone: set[str]) -> None:
        """After placement dropped ``gone`` (and its jobs and runner records): running jobs
        it took back stop without writing, idle runners there unload (busy ones as their
        last job ends)."""
        with self._jobs_lock:
            running = [run for run, p in self._running.items() if gone & set(p.devices)]
        for job_id, placement_id in running:
            holder = self.state.job_holder(job_id)
            if holder is not None and holder != placement_id:
                log.warning("job %s was taken back by placement; stopping it here", job_id)
                with self._jobs_lock:  # unless it ended meanwhile: nothing left to stop
                    if (job_id, placement_id) in self._running:
                        self._disowned.add((job_id, placement_id))
        for runner_id, runner in list(self.runners.items()):
            if gone & set(runner.device_ids) and not self._busy(runner_id):
                self._drop_local(runner_id)

    def _runs(self) -> set[tuple[str, str]]:
        """The runs under way here, those whose end is being written included."""
        with self._jobs_lock:
            return set(self._running) | self._ending

    def _write_end(
        self,
        placement: Placement,
        job_id: str,
        done: tuple[int, dict[str, Any] | None],
        orphan: SentJob | None,
    ) -> Appended:
        """A job's end in one step (lua/end.lua), then its runner's expiry here."""
        now, keep_alive_s = self.clock(), self._keep_alive_now(placement.runner_id)
        ttl_s = self.settings.stream_ttl_s
        appended, left = self.state.end(placement, job_id, done, now, keep_alive_s, ttl_s, orphan)
        self._counted_off(placement.runner_id, left, now, keep_alive_s)
        return appended

    def _fenced(self, job_id: str, placement_id: str) -> None:
        """A chunk of a run was refused: another placement of its job owns the stream
        (re-placed, or sent again when its message seemed lost), so that run stops without
        writing, as one placement took back; another run of the job here goes on."""
        run = (job_id, placement_id)
        with self._jobs_lock:
            if run not in self._running or run in self._disowned:
                return
            self._disowned.add(run)
        log.warning(
            "job %s belongs to another placement now (its chunk was refused); stopping it here",
            job_id,
        )

    # -- jobs -----------------------------------------------------------------------------
    def run_job(
        self, job: dict[str, Any], sent: dict[str, Any], progress: Progress = _silent
    ) -> dict[str, Any]:
        """Run one job to its end; returns the final record, raises a GgufqError on failure.

        ``progress(state, **fields)`` hears of LOADING and GENERATING (with a token count,
        at most once a second): Flower shows them as the task's state."""
        received, received_at = time.perf_counter_ns(), time.time()
        req = parse_request(job)
        placement = parse_placement(sent)
        runner_id = placement.runner_id
        publisher = ChunkPublisher(
            self.streams.of(req.id), req.id, self.settings.stream_ttl_s, self.chunks, placement.id
        )
        base = {"model": req.model, "job_id": req.id, "device": placement.device_id}
        # watched before the start reads its cancel flags: a cancel broadcast between the
        # two is not lost
        watched = self.cancels.watch(req.id, cancelled=False)
        start = StartClaim(self, req, placement, publisher)

        def cancelled() -> bool:
            return watched() or (req.id, placement.id) in self._disowned

        def begin(runner: AnyRunner) -> None:
            start.make()
            if cancelled():  # while it waited in the queue: its first step goes unseen
                start.unseen = True
                raise cancelled_before_start(req.id)
            publisher.release()
            start.settle(runner)

        # text on a resident runner: its start is claimed while its first step runs, off
        # its way to the first token (StartClaim holds the text until then); looked up
        # without the load lock, which another runner's load holds for seconds
        resident = self.runners.get(runner_id) if req.kind == "chat" or req.prompt else None
        meanwhile = _nothing
        ended = False

        def end(
            last: dict[str, Any] | None, tally: dict[str, float], orphan: SentJob | None = None
        ) -> bool:
            """The job's end, its ``last`` chunk with it (or, handed back, its ``orphan``
            record); False when that was fenced off."""
            nonlocal ended
            ended = True
            return self._ended(req, placement, publisher, last, tally, received_at, orphan)

        try:
            if resident is not None:
                self._check_serving(req, placement, resident)
                publisher.hold()
                progress = start.gate(progress)
                runner, load_ns = resident, 0
                meanwhile = partial(begin, runner)
            else:  # claimed before its runner is loaded: one not this delivery's loads nothing
                self._start_now(start, cancelled, progress)
                runner, load_ns = self._runner_for(req, placement)
                begin(runner)
            final: dict[str, Any] = dict(
                base, created_at=self.clock(), done=True, load_duration=load_ns
            )
            final.update(
                produce(
                    req, runner, placement, self.registry, publisher, cancelled, progress, meanwhile
                )
            )
            final["total_duration"] = time.perf_counter_ns() - received + placement.placement_ns
            # vectors travel in the result only: the stream's final chunk has the stats;
            # the stream is complete, and the slot free, before the result is stored
            last = {k: v for k, v in final.items() if k != "embeddings"}
            if not end(last, finished_tally(final)):
                raise NotOwned(req.id)  # placement ended it or placed it again meanwhile
            return final
        except HandBack as exc:
            end(None, {}, self._handed_back(start, resident, exc))
            raise
        except NotOwned:
            raise
        except Exception as exc:
            if not start.ours(resident) or (
                isinstance(exc, GgufqError) and (req.id, placement.id) in self._disowned
            ):
                raise NotOwned(req.id) from None  # its new run, or placement, writes the end
            error = self._failed(req, placement, exc)
            chunk = error_chunk(req.model, req.id, error, device=placement.device_id)
            if not end(chunk, failed_tally(error)):  # its outcome is not this run's to store
                raise NotOwned(req.id) from None
            raise error from None
        finally:
            if not ended:
                self._left(req, placement, publisher, start.owned, received_at)

    def _handed_back(self, start: StartClaim, resident: AnyRunner | None, exc: HandBack) -> SentJob:
        """The orphan record that gives a job whose model could not load here back to
        placement, which places it again elsewhere (its end writes it, in the same step
        as its in-flight record goes); raises NotOwned when the job is not this
        delivery's."""
        if not start.ours(resident):
            raise NotOwned(start.req.id) from None
        log.warning("handing job %s back to placement: %s", start.req.id, exc)
        device = start.placement.device_id
        record = SentJob(job=start.req, placement=start.placement, worker=self.worker_name)
        return record.model_copy(update={"avoid": [device] if exc.avoid_here else []})

    def _start_now(
        self, start: StartClaim, cancelled: Callable[[], bool], progress: Progress
    ) -> None:
        """Claim a job's start before its runner is loaded (a job that is not this
        delivery's loads nothing), and tell Flower when it loads."""
        start.make()
        if cancelled():
            raise cancelled_before_start(start.req.id)  # while it waited in the queue
        if start.placement.runner_id not in self.runners:
            progress("loading", device=start.placement.device_id)

    def _failed(self, req: JobRequest, placement: Placement, exc: Exception) -> GgufqError:
        """The error a job this delivery runs ends with when ``exc`` stopped it (a JobFailed
        for what is not a GgufqError)."""
        if isinstance(exc, GgufqError):
            return exc
        log.error("job %s failed", req.id, exc_info=exc)
        return JobFailed(f"job {req.id} failed on {placement.device_id}: {exc}")

    @contextmanager
    def _end_of(self, run: tuple[str, str]) -> Iterator[None]:
        """While a run's end is written: out of ``_running`` (a second delivery checks it to
        unwatch), in ``_ending`` (not a stray) until it landed or waits in the backlog."""
        with self._jobs_lock:
            self._running.pop(run, None)
            self._ending.add(run)
            self._disowned.discard(run)
        try:
            yield
        finally:
            with self._jobs_lock:
                self._ending.discard(run)

    def _ended(
        self,
        req: JobRequest,
        placement: Placement,
        publisher: ChunkPublisher,
        last: dict[str, Any] | None,
        tally: dict[str, float],
        received_at: float,
        orphan: SentJob | None = None,
    ) -> bool:
        """A job this delivery ran ended: its ``last`` chunk (None: no chunk of its own),
        its in-flight record and its runner's count go to Redis in one step (lua/end.lua),
        with its ``orphan`` record when it is handed back, then its counters and hops.
        False when the chunk was fenced off (the job was taken from this run): its outcome
        is not this run's to store."""
        run = (req.id, placement.id)
        with self._end_of(run):
            self._unwatch(req.id)
            ttl_s = self.settings.stream_ttl_s
            seq = publisher.last_seq() if last is not None else 0
            hops = dict(publisher.hops(), worker_received=received_at)
            appended = [Appended.WRITTEN]  # unknown while Redis is away: as before, stored

            def write_end() -> None:
                appended[0] = self._write_end(placement, req.id, (seq, last), orphan)
                if last is not None or orphan is not None:  # an end without either is a stop
                    fenced = appended[0] is Appended.FENCED
                    self.strays.keep(run, (seq, last), orphan, fenced)

            def bookkeeping() -> None:  # the counters and hops, in one round trip
                pipe = self.r.pipeline(transaction=False)
                count(pipe, req.model, **tally)
                if tally.get("finished") and last is not None:
                    timings = job_timings(req.submitted_at, hops, last)
                    observe(pipe, {"model": req.model, "tenant": req.tenant}, **timings)
                note_hops(pipe, req.id, ttl_s, hops)
                execute(pipe, f"counting job {req.id}")

            # through an outage too: else its slot stays taken in placement's view
            self.backlog.run(f"ending job {req.id}", self.strays.on_its_way(req.id, write_end))
            self.backlog.run(f"counting job {req.id}", bookkeeping)
            return appended[0] is not Appended.FENCED

    def _left(
        self,
        req: JobRequest,
        placement: Placement,
        publisher: ChunkPublisher,
        owned: bool,
        received_at: float,
    ) -> None:
        """A run that left before its end: one this delivery ran ends with no chunk of its
        own (handed back, unless the job is another's now: NotOwned); another stops
        watching the job."""
        if owned:
            gone = stopped_run(req, placement, self.worker_name)
            self._ended(req, placement, publisher, None, {}, received_at, gone)
        else:
            self._unwatch(req.id)

    def _unwatch(self, job_id: str) -> None:
        """Stop watching a job that does not run here, unless another delivery of it does."""
        with self._jobs_lock:
            if not self._runs_of(job_id):
                self.cancels.forget(job_id)

    def _runs_of(self, job_id: str) -> bool:
        """Whether a run of ``job_id`` is under way here (hold ``_jobs_lock``)."""
        return any(job == job_id for job, _placement in self._running)

    def _counted_off(
        self, runner_id: str, left: int, now: float, keep_alive_s: float | None
    ) -> None:
        """After a job's end counted it off its runner: the runner's keep_alive as it is now
        (a later job's explicit value, or an unload asked while it was busy) decides what
        happens next."""
        if left < 0:  # its record is gone (its device was dropped): nothing will expire it
            if not self._busy(runner_id):
                self._drop_local(runner_id)
            return
        if left > 0:
            return
        if keep_alive_s is None or keep_alive_s == 0:
            # never loaded here (its only job was cancelled in the queue, or the load failed)
            # and so nothing would expire it, or asked to go when idle: release it now
            self._unload(runner_id, why="expiries")
        else:
            self._schedule_expiry(runner_id, expires_at(now, keep_alive_s))

"""The runners one worker keeps resident: loaded when a job first needs one, unloaded when
idle past its keep_alive, when placement asks for room, or when its device was dropped.
:class:`workers.runtime.WorkerRuntime` runs jobs on them."""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import redis

from scheduler.cluster import DeviceInfo
from scheduler.errors import GgufqError, InvalidModelFile, LoadFailed
from scheduler.gguf.registry import Registry
from scheduler.protocol import JobRequest, Placement
from scheduler.settings import Settings
from scheduler.store.connection import connect
from scheduler.store.shards import stream_shards
from scheduler.store.stats import count, execute
from scheduler.store.worker_state import WorkerState
from workers.backlog import AWAY, Backlog, patiently
from workers.devices import close_and_wait
from workers.generation import AnyRunner, open_runner
from workers.handback import HandBack, RunnerGone, runner_stopped
from workers.keepalive import ExpirySchedule

log = logging.getLogger(__name__)
FAILED_LOADS_KEPT = 256
Clock = Callable[[], float]


class Residency:
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        devices: list[DeviceInfo],
        registry: Registry,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.r = client
        # where the jobs' streams live: this Redis, or those of GGUFQ_STREAM_REDIS_URLS
        self.streams = stream_shards(client, settings.stream_redis_urls, connect)
        self.state = WorkerState(client, self.streams)
        self.devices = devices
        self.registry = registry
        self.clock = clock
        self.runners: dict[str, AnyRunner] = {}
        # (job id, placement id) → its placement, while it runs here: a job sent again as a
        # new placement may run here twice at once, its first run fenced off and stopping
        self._running: dict[tuple[str, str], Placement] = {}
        self._jobs_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._expiry = ExpirySchedule()
        # runner id → why it is to unload, when that happens later than asked (a busy
        # runner asked to go when idle, an unload put off while Redis is away)
        self._why: dict[str, str] = {}
        self._marked_unloading: set[str] = set()  # runners whose loop stopped, so marked
        self._wake = threading.Condition()
        self.backlog = Backlog()  # job ends that Redis missed while it was away
        # runners whose load failed here, with why: the jobs that waited on one end as
        # its first job did (not placed again onto this device as if it had just gone)
        self._failed_loads: OrderedDict[str, Exception] = OrderedDict()
        # loads' progress, written apart from the loads (latest fraction per runner)
        self._progress: dict[str, float] = {}
        self._progress_lock = threading.Lock()
        self._progress_writer = ThreadPoolExecutor(1, thread_name_prefix="load-progress")

    # -- loading ----------------------------------------------------------------------------
    def _runner_for(self, req: JobRequest, placement: Placement) -> tuple[AnyRunner, int]:
        runner_id = placement.runner_id
        with self._load_lock:
            runner = self.runners.get(runner_id)
            if runner is not None:
                self._check_serving(req, placement, runner)
                return runner, 0
            # a job that arrives as Redis goes away waits for it, as its start claim did
            # (were its device dropped meanwhile, its hand-back or end is refused)
            phase = patiently(
                lambda: self.state.runner_phase(runner_id),
                f"looking up runner {runner_id}",
                math.inf,
            )
            failed = self._failed_loads.get(runner_id)
            if phase is None and failed is not None:  # its load failed here, as it would again
                raise self._load_error(req, placement, failed)
            if phase is None:
                gone = (
                    f"the runner for {req.model!r} on {placement.device_id} was unloaded "
                    "before this job reached it (its load failed or it expired)"
                )
                if req.attempt == 0:  # nothing of it ran: placed again, once
                    raise RunnerGone(gone)
                raise LoadFailed(gone + "; submit the job again")
            runner = self._load(req, placement)
            self.runners[runner_id] = runner
        # through an outage too: a "ready" that Redis missed (it crashed as the load ended)
        # left the runner "loading" for good: never evictable, refused by the fast path
        ready = {"state": "ready", "loaded_at": self.clock(), "worker": self.worker_name}
        self.backlog.run(
            f"marking runner {runner_id} ready", lambda: self.state.update_runner(runner_id, ready)
        )
        load_s = runner.load_duration_ns / 1e9
        tally = partial(self._count, req.model, loads=1, load_seconds=load_s)
        self.backlog.run(f"counting runner {runner_id}'s load", tally)
        return runner, runner.load_duration_ns

    def mark_loaded_ready(self) -> int:
        """Mark "ready" again the runners loaded here that Redis holds as loading: Redis
        acknowledged their "ready" and lost it (a crash takes its last second of writes),
        and nothing else would write it again. Returns how many."""
        phases = self.state.runner_phases(list(self.runners))
        stale = [r for r, phase in phases.items() if phase == "loading" and r in self.runners]
        for runner_id in stale:
            log.warning("runner %s is loaded but Redis lost its 'ready': written again", runner_id)
            self.state.update_runner(runner_id, {"state": "ready", "worker": self.worker_name})
        return len(stale)

    def _count(self, model: str, **amounts: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        count(pipe, model, **amounts)
        execute(pipe, f"counting {model}'s runners")

    def _load(self, req: JobRequest, placement: Placement) -> AnyRunner:
        on_load = partial(self._loaded_so_far, placement.runner_id)
        try:
            return open_runner(req, placement, self.registry, self.settings, on_load)
        except (GgufqError, ValueError, RuntimeError, OSError) as exc:
            self._release(placement.runner_id, placement.devices)
            self._failed_loads[placement.runner_id] = exc  # for the jobs that wait on it
            while len(self._failed_loads) > FAILED_LOADS_KEPT:
                self._failed_loads.popitem(last=False)
            raise self._load_error(req, placement, exc) from None

    def _loaded_so_far(self, runner_id: str, fraction: float) -> None:
        """A load's progress on its runner's record (/api/ps, the clients that wait for it).
        Called from inside llama.cpp's load, which must never wait for Redis: the fraction
        is handed to one writer thread, which writes the latest one (a write Redis misses
        is skipped; the next one, or "ready", follows)."""
        with self._progress_lock:
            due = runner_id not in self._progress  # else the write on its way takes this
            self._progress[runner_id] = fraction
        if due:
            self._progress_writer.submit(self._write_progress, runner_id)

    def _write_progress(self, runner_id: str) -> None:
        with self._progress_lock:
            fraction = self._progress.pop(runner_id)
        try:
            self.state.update_runner(runner_id, {"load_progress": f"{fraction:.3f}"})
        except Exception as exc:  # Redis away, or anything: the load goes on regardless
            log.debug("runner %s's load progress not written: %s", runner_id, exc)

    def _load_error(self, req: JobRequest, placement: Placement, exc: Exception) -> Exception:
        """How a job ends whose runner could not load here (``exc``): placed again once
        elsewhere, or failed saying why."""
        if isinstance(exc, InvalidModelFile | LoadFailed):
            return exc
        device = placement.device_id
        if req.attempt == 0 and not device.startswith("cpu:"):
            # perhaps out of GPU memory (drivers and other processes take some):
            # placement tries once more, on another device
            return HandBack(f"loading {req.model!r} on {device} failed: {exc}")
        return LoadFailed(
            f"llama.cpp could not load model {req.model!r} on {device}"
            + (f" (nor on {', '.join(req.avoid)})" if req.avoid else "")
            + f" ({exc}); check that the file is a "
            "complete GGUF of an architecture this llama.cpp supports (`ggufq models`)"
        )

    def _check_serving(self, req: JobRequest, placement: Placement, runner: AnyRunner) -> None:
        """Raise for a job that reached a runner whose decode loop stopped on a bug: placed
        again once (nothing of it ran here), else failed saying what happened. The runner
        unloads as soon as no job counts on it (:meth:`_keep_alive_now`)."""
        if runner.stopped is None:
            return
        self._route_no_more(runner.id)
        raise runner_stopped(req, placement.device_id, runner.stopped)

    def _keep_alive_now(self, runner_id: str) -> float | None:
        """A runner's keep_alive as a job's end leaves it (None: no such runner here); 0 for
        one whose decode loop stopped on a bug, which then unloads once no job counts on
        it, counted as a breakdown."""
        runner = self.runners.get(runner_id)
        if runner is None:
            return None
        if runner.stopped is not None:
            runner.keep_alive_s = 0
            self._route_no_more(runner_id)
        return runner.keep_alive_s

    def _unload_stopped(self) -> None:
        """Unload each runner whose decode loop stopped once no job counts on it, however
        its last count went: a job's end here unloads it at once, but placement may count
        off the last one itself (a job it never sent: lua/prune.lua, lua/unsend.lua)."""
        for runner_id, runner in list(self.runners.items()):
            if runner.stopped is None or self._busy(runner_id):
                continue
            self._route_no_more(runner_id)
            if not self.state.runner_in_flight(runner_id):  # none, or its record gone
                self._unload(runner_id, why="breakdowns")

    def _route_no_more(self, runner_id: str) -> None:
        """Mark a runner whose decode loop stopped unloading at once, though jobs still
        count on it: placement routes none to it (a job placed again would meet it);
        it unloads here as the last of them ends. Once; a Redis that refuses leaves it to
        that end."""
        self._why[runner_id] = "breakdowns"  # whatever unloads it, and when
        if runner_id in self._marked_unloading:
            return
        try:
            self.state.begin_unload(runner_id, force=True)  # else unloading, or gone: as well
        except redis.RedisError as exc:
            log.warning("runner %s not marked unloading yet: %s", runner_id, exc)
            return
        self._marked_unloading.add(runner_id)

    # -- unloading --------------------------------------------------------------------------
    def request_unload(self, runner_id: str, when_idle: bool = False) -> bool:
        """Unload a runner if it is idle (placement asks this to make room).

        With ``when_idle`` (``ggufq unload``) a busy runner unloads as its last job ends.
        """
        runner = self.runners.get(runner_id)
        if runner is None:
            return False
        why = "unloads" if when_idle else "evictions"
        if when_idle:
            runner.keep_alive_s = 0
            self._why[runner_id] = why
        self._schedule_expiry(runner_id, None)
        return self._unload_or_later([runner_id], why)

    def _unload_or_later(self, runner_ids: list[str], why: str) -> bool:
        """Unload each runner; when Redis is away, it and the rest are left to the expiry
        loop a second later (else they would stay loaded, their expiry cleared). Whether
        the last one unloaded now."""
        unloaded = False
        for i, runner_id in enumerate(runner_ids):
            try:
                unloaded = self._unload(runner_id, why=why)
            except AWAY as exc:
                log.warning("unloading runner %s waits for Redis: %s", runner_id, exc)
                for later in runner_ids[i:]:
                    self._why.setdefault(later, why)
                    self._schedule_expiry(later, self.clock() + 1.0)
                return False
        return unloaded

    def _unload(self, runner_id: str, force: bool = False, why: str | None = None) -> bool:
        """Unload a runner; ``why`` names the counter its unloading adds to (evictions,
        expiries, unloads: scheduler/store/stats.py), None counts nothing (a shutdown)."""
        if not self.state.begin_unload(runner_id, force=force):
            phase = self.state.runner_phase(runner_id)
            # a job arrived meanwhile, or another unload is under way; unless "unloading"
            # is this worker's own earlier try, whose reply an outage lost
            mine = phase == "unloading" and runner_id in self.runners and not self._busy(runner_id)
            if phase is not None and not mine:
                return False
        runner = self.runners.pop(runner_id, None)
        self._marked_unloading.discard(runner_id)
        device_ids = runner.device_ids if runner else []
        if runner is not None:
            self._close(runner)
        # through an outage too: else its reservation stays taken in placement's view
        self.backlog.run(
            f"releasing runner {runner_id}", lambda: self._release(runner_id, device_ids)
        )
        why = self._why.pop(runner_id, why)  # as asked, if it was asked earlier
        if runner is not None and why is not None:
            tally = partial(self._count, runner.model, **{why: 1})
            self.backlog.run(f"counting runner {runner_id}'s unloading", tally)
        log.info("unloaded runner %s", runner_id)
        return True

    def _busy(self, runner_id: str) -> bool:
        with self._jobs_lock:
            return any(p.runner_id == runner_id for p in self._running.values())

    def _drop_local(self, runner_id: str) -> None:
        """Unload a runner whose record placement already removed (nothing to release)."""
        self._schedule_expiry(runner_id, None)
        self._why.pop(runner_id, None)
        runner = self.runners.pop(runner_id, None)
        self._marked_unloading.discard(runner_id)
        if runner is not None:
            runner.close()
            log.info("unloaded runner %s: its device had been dropped", runner_id)

    def _close(self, runner: AnyRunner) -> None:
        """Free llama.cpp's memory; on NVIDIA GPUs wait (bounded) until the driver shows it."""
        gpus = [d for d in self.devices if d.kind == "gpu" and d.id in runner.device_ids]
        try:
            reserved = self.state.runner_devices(runner.id) if gpus else {}
        except AWAY:  # close it anyway (not waiting for the driver): it is out of self.runners
            reserved = {}
        wait = self.settings.unload_wait_s
        if not close_and_wait(runner.close, gpus, reserved, wait):
            log.warning(
                "the driver still shows runner %s's memory in use %.0f s after unloading; "
                "releasing its reservation anyway",
                runner.id,
                wait,
            )

    def _release(self, runner_id: str, device_ids: list[str]) -> None:
        held = device_ids or [d.id for d in self.devices]
        self.state.release(runner_id, held)

    # -- expiry ---------------------------------------------------------------------------
    def _expire_due(self) -> None:
        """Unload the runners whose keep_alive ran out, and the stopped ones no job counts
        on; waits up to a second for one."""
        self._unload_stopped()
        with self._wake:
            due = self._expiry.pop_due(self.clock())
            if not due:
                next_at = self._expiry.next_at()
                timeout = 1.0 if next_at is None else max(0.0, next_at - self.clock())
                self._wake.wait(min(timeout, 1.0))
                return
        self._unload_or_later(due, "expiries")

    def _schedule_expiry(self, runner_id: str, at: float | None) -> None:
        with self._wake:
            self._expiry.set(runner_id, at)
            self._wake.notify_all()

    @property
    def worker_name(self) -> str:
        return self.devices[0].worker if self.devices else ""

"""The placement service: takes jobs from the placement queue and sends each to a device.

Around the pure :func:`scheduler.placement.decision.decide` it does the I/O: read the snapshot,
reserve memory atomically, send the job to the device's Celery queue, ask workers to
unload idle runners, park, or refuse with a reason.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, NoReturn

import redis
from celery import Celery, signals

from scheduler.cluster import DeviceState, Snapshot
from scheduler.errors import (
    GgufqError,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    LoadFailed,
    error_from_code,
)
from scheduler.gguf.estimate import (
    RunnerConfig,
    choose_num_ctx,
    estimate_bytes,
    group_parts,
    partial_table,
)
from scheduler.gguf.metadata import ModelInfo
from scheduler.gguf.registry import Registry
from scheduler.placement.decision import (
    Evict,
    GroupNeeds,
    JobNeeds,
    Load,
    Park,
    Refuse,
    Route,
    decide,
    server_busy,
)
from scheduler.placement.metrics import serve_metrics
from scheduler.placement.parking import ParkedJobs, park_score
from scheduler.placement.snapcache import SnapshotCache
from scheduler.protocol import JobRequest, parse_request
from scheduler.settings import Settings, get_settings
from scheduler.store import keys
from scheduler.store.cancel import cancelled_before_start, is_cancelled
from scheduler.store.celery_app import ask_unload, make_app, send_job
from scheduler.store.connection import resolve_redis_url
from scheduler.store.state import ClusterState
from scheduler.store.streams import error_chunk, progress, publish_final

log = logging.getLogger("ggufq.placement")


def format_warning(req: JobRequest) -> str | None:
    """Constrained to JSON by a prompt that never asks for JSON, models tend to emit endless
    whitespace (a lesson from Ollama)."""
    if req.format is None or "json" in req.prompt.lower():
        return None
    return (
        "format asks for JSON but the prompt never mentions JSON; models then tend to emit "
        "endless whitespace: ask for JSON in the prompt"
    )


def lost_job_message(job_id: str, where: str, streamed: int) -> str:
    what = (
        f"after it had streamed {streamed} chunks (its partial output stays in the job's "
        "stream), so it was not re-run"
        if streamed
        else "after it had already been re-run once"
    )
    return (
        f"job {job_id} was lost: worker {where} stopped heartbeating while it held the job, "
        f"{what}; submit it again"
    )


class Parked(Exception):
    """The job was parked: it waits in Redis for capacity."""


def behind_parked(model: str, parked: int, max_queue: int) -> Park | Refuse:
    if parked >= max_queue:
        return server_busy(parked, max_queue)
    return Park(f"earlier jobs for {model!r} are waiting")


def restricted(
    snap: Snapshot,
    keep: Callable[[DeviceState], bool],
    none_left: str,
    error: type[GgufqError] = InvalidRequest,
) -> Snapshot:
    """The part of the snapshot on the devices ``keep`` accepts (``error`` if none)."""
    devices = [d for d in snap.devices if keep(d)]
    if not devices:
        alive = ", ".join(d.id for d in snap.devices) or "none"
        raise error(f"{none_left}; alive devices: {alive} (`ggufq devices`)")
    ids = {d.id for d in devices}
    runners = [r for r in snap.runners if set(r.devices) <= ids]
    return Snapshot(devices, runners, snap.parked, snap.demand)


def pinned(snap: Snapshot, device_id: str) -> Snapshot:
    """The part of the snapshot a job pinned to one device may use."""
    return restricted(snap, lambda d: d.id == device_id, f"device {device_id!r} is not alive")


def gpu_layers_rule(snap: Snapshot, num_gpu: int, whole: int) -> Snapshot:
    """Ollama's num_gpu: 0 = the CPU only; -1 = as many layers on a GPU as fit; otherwise
    that many layers, all on GPUs (``whole`` = every block and the output layer)."""
    if num_gpu == 0:
        return restricted(
            snap,
            lambda d: d.kind == "cpu",
            "num_gpu 0 asks for the CPU but no CPU device is alive: start a worker with "
            "`ggufq worker --cpu`, or omit num_gpu",
        )
    if num_gpu > 0:
        return restricted(
            snap,
            lambda d: d.kind != "cpu",
            f"num_gpu {num_gpu} asks for {min(num_gpu, whole)} layers on a GPU but no GPU is "
            "alive: omit num_gpu (or set -1) to run where the model fits",
        )
    return snap


def _has_gpu_groups(snap: Snapshot) -> bool:
    """Whether some worker owns several GPUs (so a model may span them: branch 4)."""
    seen: set[str] = set()
    for d in snap.devices:
        if d.kind != "cpu":
            if d.worker in seen:
                return True
            seen.add(d.worker)
    return False


class PlacementService:
    def __init__(self, settings: Settings, client: redis.Redis, app: Celery) -> None:
        self.settings = settings
        self.r = client
        self.app = app
        self.state = ClusterState(client)
        self.registry = Registry(settings.models_dir)
        self.parked = ParkedJobs(client)
        self.snapshots = SnapshotCache(client)
        self._partials: dict[tuple[str, RunnerConfig], tuple[int, ...]] = {}
        self._groups: dict[tuple[str, RunnerConfig], GroupNeeds] = {}
        self.name = f"placement-{settings.host_id}-{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        # placements of this process run one at a time: the Celery task and the parked-job
        # waker both place, and the snapshot cache (its indexes are views into it) and the
        # memo dicts above are not safe to update from two threads at once
        self._placing = threading.RLock()

    def place(self, job: dict[str, Any]) -> dict[str, Any]:
        """Place a newly submitted job: send it to a device, park it, or refuse it."""
        started = time.perf_counter_ns()
        try:
            req = parse_request(job)
            if is_cancelled(self.r, req.id):
                raise cancelled_before_start(req.id)
            try:
                outcome = self._place(req, started)
            except Parked as parked:
                outcome = {"parked": str(parked)}
            # counted after sending, off the job's path to its first token; the eviction
            # order uses it (decision branch 5)
            self.state.count_request(req.model, time.time())
            return outcome
        except GgufqError as exc:
            self.fail(str(job.get("id", "")), str(job.get("model", "")), exc)
            return {"refused": exc.code, "reason": str(exc)}

    def retry_parked(self) -> int:
        """Retry parked jobs in order; returns how many left the queue.

        After one job of a model parks again, later jobs of that model are not tried: they
        could not run either, and must not overtake it.
        """
        moved, blocked = 0, set()
        for req in self.parked.jobs():
            if req.model in blocked:
                continue
            claimed = self.parked.claim(req.id)
            if claimed is None:
                continue  # another placement process took it
            job, score = claimed
            try:
                if is_cancelled(self.r, job.id):
                    raise cancelled_before_start(job.id)
                self._place(job, time.perf_counter_ns(), score=score)
                moved += 1
            except Parked:
                blocked.add(job.model)
            except GgufqError as exc:
                self.fail(job.id, job.model, exc)
                moved += 1
        return moved

    def _place(self, req: JobRequest, started: int, score: float | None = None) -> dict[str, Any]:
        """Decide and carry out; ``score`` is set when a parked job is retried."""
        with self._placing:
            return self._place_now(req, started, score)

    def _place_now(self, req: JobRequest, started: int, score: float | None) -> dict[str, Any]:
        info = self.registry.info(req.model)
        default_ctx = self.settings.embed_num_ctx if req.kind == "embed" else self.settings.num_ctx
        num_ctx, warning = choose_num_ctx(req.options.num_ctx, default_ctx, info.context_length)
        slots = req.options.num_parallel
        parallel = slots or self._slots(req.model)
        fa = self.settings.flash_attention
        if req.kind == "embed":
            slots, config = None, RunnerConfig.for_embedding(num_ctx, fa)
        else:
            config = RunnerConfig.for_generation(num_ctx, parallel, fa)
        needs = JobNeeds(req.model, config.key(), estimate_bytes(info, config), num_parallel=slots)
        retry = score is not None
        order = score if score is not None else park_score(req, time.time())
        for _attempt in range(8):  # lost races against other placers: decide again
            now = time.time()
            snap = self.snapshots.snapshot(now, self.settings.device_ttl_s)
            if req.device is not None:
                snap = pinned(snap, req.device)
            if req.avoid:
                snap = restricted(
                    snap,
                    lambda d: d.id not in req.avoid,
                    f"model {req.model!r} could not be loaded on {', '.join(req.avoid)} and "
                    "no other device can take it",
                    LoadFailed,
                )
            whole = info.block_count + 1
            snap = gpu_layers_rule(snap, req.options.num_gpu, whole)
            if 0 < req.options.num_gpu < whole:  # exactly that many layers on the GPU
                layers = req.options.num_gpu
                needs = replace(needs, bytes=self._partial(info, config)[layers - 1])
                needs = replace(needs, n_gpu_layers=layers, group=None)
            elif req.options.num_gpu >= whole:
                needs = replace(needs, n_gpu_layers=0)  # whole on GPUs: no partial runner
            elif (
                req.options.num_gpu < 0
                and snap.devices
                and needs.bytes > max(d.total for d in snap.devices)
            ):
                needs = replace(needs, partial=self._partial(info, config))
            if needs.group is None and needs.n_gpu_layers < 0 and _has_gpu_groups(snap):
                needs = replace(needs, group=self._group(info, config))
            decision = decide(
                needs,
                snap,
                self.settings.placement_policy,
                now,
                # a retried job is already in the queue: never refuse it as "busy"
                self.settings.max_queue + (snap.parked + 1 if retry else 0),
                self.settings.max_loaded_models,
            )
            if (
                not retry
                and isinstance(decision, Load | Evict)
                and snap.parked
                and req.model in self.parked.models()
            ):
                # A loaded runner takes a job at once; a job that needs a new runner waits
                # behind the parked jobs of its model, so that a model's jobs keep their order.
                decision = behind_parked(req.model, snap.parked, self.settings.max_queue)
            placement: dict[str, Any] = {
                "config": asdict(config),
                "warnings": [w for w in (warning, format_warning(req)) if w],
            }
            match decision:
                case Route(runner_id, device_id):
                    if not self.state.assign(runner_id, now):
                        continue
                    placement.update(runner_id=runner_id, device_id=device_id)
                case Load(device_id, nbytes, n_gpu_layers, split) as load:
                    runner_id = uuid.uuid4().hex[:16]
                    fields = {
                        "model": req.model,
                        "config_key": needs.config_key,
                        "num_ctx": config.num_ctx,
                        "num_parallel": config.num_parallel,
                        "embedding": int(config.embedding),
                        "bytes": nbytes,
                        "total_bytes": needs.bytes,
                        "n_gpu_layers": n_gpu_layers,
                        "block_count": info.block_count,
                        "keep_alive_s": self.settings.keep_alive_s,
                    }
                    if not self.state.reserve(
                        runner_id, load.reservations, fields, now, self.settings.device_ttl_s
                    ):
                        continue
                    kind = next(d.kind for d in snap.devices if d.id == device_id)
                    placement.update(
                        runner_id=runner_id,
                        device_id=device_id,
                        device_ids=list(load.reservations),
                        # blocks per device in layer order, for llama.cpp's tensor_split
                        split_blocks=[blocks for _dev, _bytes, blocks in split],
                        n_gpu_layers=0 if kind == "cpu" else n_gpu_layers,
                    )
                case Evict(runner_ids):
                    self._evict(runner_ids, snap)
                    self._park(req, order)
                case Park(reason):
                    log.info("job %s parked: %s", req.id, reason)
                    self._park(req, order)
                case Refuse(code, reason):
                    raise error_from_code(code, reason)
            placement["id"] = uuid.uuid4().hex[:12]
            placement["placement_ns"] = time.perf_counter_ns() - started
            worker = next(d.worker for d in snap.devices if d.id == placement["device_id"])
            record = {
                "job": req.model_dump(mode="json"),
                "placement": placement,
                "worker": worker,
                "sent_at": time.time(),
            }
            self.state.sent(placement["device_id"], req.id, record)
            queue = keys.device_queue(placement["device_id"], req.priority)
            send_job(self.app, keys.TASK_RUN, req, req.id, queue, placement)
            return {"device": placement["device_id"], "runner": placement["runner_id"]}
        self._park(req, order)

    def _slots(self, model: str) -> int:
        """num_parallel for a new runner of ``model``: per model, else the default."""
        return self.settings.model_parallel.get(model, self.settings.num_parallel)

    def _partial(self, info: ModelInfo, config: RunnerConfig) -> tuple[int, ...]:
        key = (info.path, config)
        if key not in self._partials:
            self._partials[key] = partial_table(info, config)
        return self._partials[key]

    def _group(self, info: ModelInfo, config: RunnerConfig) -> GroupNeeds:
        key = (info.path, config)
        if key not in self._groups:
            self._groups[key] = GroupNeeds(*group_parts(info, config))
        return self._groups[key]

    def _park(self, req: JobRequest, score: float) -> NoReturn:
        self.parked.park(req, score)
        raise Parked(req.id)

    def _evict(self, runner_ids: list[str], snap: Any) -> None:
        by_id = {r.id: r for r in snap.runners}
        workers = {d.id: d.worker for d in snap.devices}
        for runner_id in runner_ids:
            device_id = next(iter(by_id[runner_id].devices))
            ask_unload(self.app, workers[device_id], runner_id)

    def fail(self, job_id: str, model: str, exc: GgufqError) -> None:
        """End a job that will never run: a final error chunk and a FAILURE result."""
        if not job_id:
            return
        self.parked.drop(job_id)
        publish_final(self.r, job_id, error_chunk(model, job_id, exc), self.settings.stream_ttl_s)
        if isinstance(exc, JobCancelled):
            self.app.backend.mark_as_revoked(job_id, reason=str(exc))
        else:
            self.app.backend.mark_as_failure(job_id, exc)

    def recover_orphans(self) -> int:
        """Handle the jobs that were sent to devices since dropped (their worker died or
        stopped): re-place a job once when nothing of it had been streamed, otherwise end it
        with an error that says what happened. Returns how many were handled."""
        handled = 0
        for job_id in self.state.orphans():
            record = self.state.claim_orphan(job_id)
            if record is None:
                continue  # another placement process handles it
            handled += 1
            req = parse_request(record["job"])
            streamed, finished = progress(self.r, job_id)
            if finished:
                continue  # it ended before its device was dropped
            where = f"{record['worker']} ({record['placement']['device_id']})"
            if is_cancelled(self.r, job_id):
                self.fail(job_id, req.model, cancelled_before_start(job_id))
            elif streamed == 0 and req.attempt == 0:
                log.warning("re-placing job %s from %s", job_id, where)
                avoid = req.avoid + record.get("avoid", [])
                self._replace(req.model_copy(update={"attempt": 1, "avoid": avoid}))
            else:
                self.fail(job_id, req.model, JobFailed(lost_job_message(job_id, where, streamed)))
        return handled

    def _replace(self, req: JobRequest) -> None:
        try:
            self._place(req, time.perf_counter_ns())
        except Parked:
            pass
        except GgufqError as exc:
            self.fail(req.id, req.model, exc)

    def cancel_parked(self, job_id: str) -> bool:
        """End a parked job that was asked to cancel; False if it is not parked here."""
        claimed = self.parked.claim(job_id)
        if claimed is None:
            return False
        self.fail(job_id, claimed[0].model, cancelled_before_start(job_id))
        return True

    # -- liveness --------------------------------------------------------------------------
    def start(self) -> None:
        if self.settings.metrics_port:
            serve_metrics(self.r, self.settings.metrics_port, self.settings.device_ttl_s)
        threading.Thread(target=self._alive_loop, name="ggufq-placement-alive", daemon=True).start()
        threading.Thread(target=self._wake_loop, name="ggufq-placement-wake", daemon=True).start()

    def _wake_loop(self) -> None:
        """Retry parked jobs when an event says capacity may have freed.

        Pub/sub drops messages while disconnected, so a slow sweep
        (GGUFQ_PARK_SWEEP_S) also retries; events, not the sweep, are the normal path.
        """
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.EVENTS, keys.CANCELS)
        next_sweep = time.monotonic() + self.settings.park_sweep_s
        while not self._stop.is_set():
            try:
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message["channel"].decode() == keys.CANCELS:
                    self.cancel_parked(message["data"].decode())
                    continue
                if message is not None and b"handed_back" in message["data"]:
                    self.recover_orphans()
                due = time.monotonic() >= next_sweep
                if (message is not None or due) and self.r.zcard(keys.PARKED):
                    self.retry_parked()
                if due:
                    next_sweep = time.monotonic() + self.settings.park_sweep_s
            except redis.RedisError as exc:
                log.warning("parked-job waker: %s", exc)
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self.state.placement_gone(self.name)

    def _alive_loop(self) -> None:
        while True:
            try:
                self.state.placement_beat(self.name, time.time(), self.settings.device_ttl_s)
                dropped = self.state.reap(time.time(), self.settings.device_ttl_s)
                if dropped:
                    log.warning("dropped devices without heartbeat: %s", ", ".join(dropped))
                self.recover_orphans()
            except redis.RedisError as exc:
                log.warning("placement heartbeat failed: %s", exc)
            if self._stop.wait(self.settings.heartbeat_interval_s):
                return


def run_service(settings: Settings) -> None:
    redis_url = resolve_redis_url(settings)
    app = make_app(redis_url, settings)
    service = PlacementService(settings, redis.Redis.from_url(redis_url), app)

    @app.task(name=keys.TASK_PLACE, ignore_result=True)
    def place(job: dict[str, Any]) -> dict[str, Any]:
        return service.place(job)

    @signals.worker_ready.connect(weak=False)
    def _ready(**_: Any) -> None:
        service.start()

    @signals.worker_shutdown.connect(weak=False)
    def _shutdown(**_: Any) -> None:
        service.stop()

    app.worker_main(
        [
            "worker",
            "-Q",
            f"{keys.placement_queue('interactive')},{keys.placement_queue('batch')}",
            "-P",
            "solo",  # placement takes ~2 ms: run it on the consumer thread, no hand-off
            "-c",
            "1",  # jobs for one model keep their order
            "-n",
            f"{service.name}@{settings.host_id}",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "INFO",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="ggufq placement", description=__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run_service(get_settings())


if __name__ == "__main__":
    main()

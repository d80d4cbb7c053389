"""The placement service: takes jobs from the placement queue and sends each to a device.

Around the pure :func:`scheduler.placement.decision.decide` it does the I/O: read the snapshot,
reserve memory atomically, send the job to the device's Celery queue, ask workers to
unload idle runners, park, or refuse with a reason.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from functools import partial
from typing import Any, NoReturn

import redis
from celery import Celery

from scheduler.cluster import Snapshot
from scheduler.errors import (
    GgufqError,
    JobCancelled,
    JobFailed,
    ModelNotFound,
    NoWorkers,
    error_from_code,
)
from scheduler.fairness import FairPasses
from scheduler.gguf.estimate import choose_num_ctx
from scheduler.gguf.registry import Registry
from scheduler.placement.affinity import AffinityMap, job_key
from scheduler.placement.commit import Assigned, Wait, commit
from scheduler.placement.decision import decide
from scheduler.placement.fastroute import route_for
from scheduler.placement.ledger import RedisLedger
from scheduler.placement.needs import Defaults, config_of, format_warning, job_needs, runner_config
from scheduler.placement.parking import HeldJobs, LazySet, ParkedJobs, park_score
from scheduler.placement.recovery import Recovery
from scheduler.placement.shapes import Shapes, runner_fields
from scheduler.placement.snapcache import SnapshotCache
from scheduler.placement.verdict import Park, Refuse
from scheduler.placement.wakes import EVERYTHING, Wake
from scheduler.protocol import JobRequest, Placement, SentJob, parse_request
from scheduler.settings import Settings
from scheduler.store.cancel import cancelled_before_start, is_cancelled
from scheduler.store.celery_app import run_message
from scheduler.store.clock import RedisClock
from scheduler.store.connection import connect
from scheduler.store.hands import Hands, parked_record
from scheduler.store.hops import note as note_hops
from scheduler.store.placement_state import PlacementState
from scheduler.store.routes import publish_route
from scheduler.store.scripts import execute
from scheduler.store.shards import stream_shards
from scheduler.store.streams import Appended, error_chunk, publish_final

log = logging.getLogger("ggufq.placement")


MAX_PLACEMENT_ERRORS = 3  # unexpected failures of one job's placement before it fails
MAX_HELD = 10_000  # jobs held in memory through a Redis outage, at most


class Parked(Exception):
    """The job was parked: it waits in Redis for capacity."""


class SweptAway(Exception):
    """Another placement process put the job back while this one held it (this one had
    stalled past the TTL): it is that one's now, and nothing more is done with it here."""


class PlacementService:
    def __init__(self, settings: Settings, client: redis.Redis, app: Celery) -> None:
        self.settings = settings
        self.r = client
        self.app = app
        self.name = f"placement-{settings.host_id}-{uuid.uuid4().hex[:6]}"
        # liveness is judged on Redis's clock; the beat loop keeps this one on it
        self.clock = RedisClock(client)
        with contextlib.suppress(redis.RedisError):  # else its beat loop syncs it
            self.clock.sync()  # before the first job: its own clock may be far off
        # the jobs it handles, in Redis; their streams there or on GGUFQ_STREAM_REDIS_URLS
        streams = stream_shards(client, settings.stream_redis_urls, connect, placement=True)
        self.hands = Hands(client, self.name, streams)
        self.state = PlacementState(client, self.hands)
        self.ledger = RedisLedger(self.state, app, settings.device_ttl_s)
        self.defaults = Defaults.of(settings)
        self.affinity = AffinityMap()  # prompt prefix → the runner that served it last
        self.passes = FairPasses()  # tenants' turns among parked jobs, across retry rounds
        self.registry = Registry(settings.models_dir)
        self.parked = ParkedJobs(client, self.hands)
        self.snapshots = SnapshotCache(client)
        self.shapes = Shapes()  # the memory each (model file, configuration) needs
        self.held = HeldJobs(self.parked, MAX_HELD)  # through a Redis outage
        self.recovery = Recovery(
            client,
            app,
            self.state,
            self.held,
            self.fail_or_hold,
            self._replace,
            settings.device_ttl_s,
            settings.stream_ttl_s,
            settings.resume_max,
        )
        # until then (monotonic), "no device is alive" parks a job instead of failing it:
        # Redis, or this process, was away, and the workers have yet to beat again
        self.grace_until = 0.0
        # a placement claim lives as long as the submission's id (api_client's _claim_id)
        self._claim_ttl_s = int(max(settings.result_ttl_s, settings.stream_ttl_s))
        # placements of this process run one at a time: the Celery task and the parked-job
        # waker both place, and the snapshot cache (its indexes are views into it) and the
        # memo dicts above are not safe to update from two threads at once
        self._placing = threading.RLock()

    def place(self, job: Any) -> dict[str, Any]:
        """Place a newly submitted job: send it to a device, park it, or refuse it."""
        started, at = time.perf_counter_ns(), time.time()
        try:
            req = parse_request(job if isinstance(job, dict) else {"malformed": job})
        except GgufqError as exc:
            fields = job if isinstance(job, dict) else {}
            self.fail(str(fields.get("id", "")), str(fields.get("model", "")), exc)
            return {"refused": exc.code, "reason": str(exc)}
        score, delivery = park_score(req, time.time()), uuid.uuid4().hex
        try:
            record = parked_record(job, score)  # what it is put back as, if this process dies
            claim = self.state.place_once(req.id, delivery, self._claim_ttl_s, record)
        except redis.RedisError as exc:  # Redis away: whether it is ours is known later
            return self._hold(req, exc, score, 0, delivery)
        if not claim.first:
            log.warning("job %s was delivered again; it is placed once", req.id)
            return {"duplicate": req.id}
        outcome = self._attempt(req, started, score, errors=0, new=True, cancelled=claim.cancelled)
        sent = "route" in outcome  # with its hops and route (None: no single runner)
        if sent:
            self.hands.hand_over(req.id)  # its send let go of it
        route = outcome.pop("route", None)
        hops = dict(outcome.pop("hops", {}), submitted=req.submitted_at, placement_received=at)
        # after sending, off the job's path to its first token: its request counted (the
        # eviction order uses it: decision branch 10), its hops, its route (the fast path)
        with contextlib.suppress(redis.RedisError):
            pipe = self.r.pipeline(transaction=False)
            if outcome.get("refused") != ModelNotFound.code:  # a name that is no model
                self.state.count_request(req.model, time.time(), pipe)  # is not its demand
            note_hops(pipe, req.id, self.settings.stream_ttl_s, hops)
            if sent and self.settings.fast_path:
                publish_route(pipe, req, route)
            execute(pipe)
        return outcome

    def retry_parked(self, wake: Wake = EVERYTHING) -> int:
        """Retry the parked jobs ``wake`` names, in order: every one, or only those of the
        models whose runners freed slots, sending at most one per slot onto those runners
        (a job sent elsewhere takes none); returns how many left the queue.

        After one job parks again, later jobs of its model and configuration are not
        tried: they could not run either, and must not overtake it.
        """
        moved, blocked, sent = 0, set(), Counter[str]()
        for job_id, req in self.parked.entries(self.passes.ahead(), wake.models):
            if req is not None and config_of(req) in blocked:
                continue
            taken = req is not None and sent[req.model] >= wake.slots.get(req.model, 0)
            if taken and not wake.everything:
                continue  # the slots freed for its model are taken: it would park again
            try:
                with self.held.takes():  # one Redis did not answer: asked again once it is back
                    claimed = self.parked.claim(job_id)
            except GgufqError as exc:  # its record does not parse: fail it alone
                self.fail_or_hold(job_id, "", exc)
                moved += 1
                continue
            if claimed is None:
                continue  # another placement process took it
            outcome = self._attempt(
                claimed.job,
                time.perf_counter_ns(),
                claimed.score,
                claimed.errors,
                cancelled=claimed.cancelled,
            )
            if "device" in outcome:
                self.hands.hand_over(job_id)  # its send let go of it
                if outcome.get("runner") in wake.runners:
                    sent[claimed.job.model] += 1
            if "parked" in outcome:
                blocked.add(config_of(claimed.job))
            else:
                moved += 1
                self.passes.served(claimed.job.tenant, claimed.job.weight)
        return moved

    def _attempt(
        self,
        req: JobRequest,
        started: int,
        score: float,
        errors: int,
        new: bool = False,
        cancelled: bool | None = None,
    ) -> dict[str, Any]:
        """Place a job that nobody else holds now (new, claimed from the parked queue, or an
        orphan): every way out ends with the job sent, parked or failed, never dropped.
        ``cancelled`` is given when known (read with a new job's claim), else read here."""
        try:
            if cancelled if cancelled is not None else is_cancelled(self.r, req.id):
                raise cancelled_before_start(req.id)
            return self._place(req, started, None if new else score)
        except Parked as parked:
            return {"parked": str(parked)}
        except SweptAway as swept:
            return {"swept": str(swept)}
        except GgufqError as exc:
            self.fail_or_hold(req.id, req.model, exc)
            return {"refused": exc.code, "reason": str(exc)}
        except Exception as exc:  # a broker or Redis error mid-step, or a bug
            return self._not_placed(req, exc, score, errors + 1)

    def _not_placed(
        self, req: JobRequest, exc: Exception, score: float, errors: int
    ) -> dict[str, Any]:
        """Park a job whose placement failed unexpectedly, to try again; fail it after
        MAX_PLACEMENT_ERRORS such failures; hold it here while Redis is away."""
        log.exception("placing job %s failed (%d times): %s", req.id, errors, exc)
        try:
            if errors < MAX_PLACEMENT_ERRORS:
                self.parked.park(req, score, errors)
                return {"parked": f"placement failed, will retry: {exc}"}
            error = JobFailed(
                f"job {req.id} could not be placed: {exc} ({errors} tries); submit it again"
            )
            self.fail(req.id, req.model, error)
            return {"refused": error.code, "reason": str(error)}
        except Exception as again:  # Redis is away
            return self._hold(req, again, score, errors)

    def _hold(
        self, req: JobRequest, exc: Exception, score: float, errors: int, delivery: str = ""
    ) -> dict[str, Any]:
        """Keep a job in this process until Redis is back; ``delivery`` is set when its
        claim (``place_once``) is still to be made."""
        if not self.held.hold(req, score, errors, delivery):
            log.error("job %s is lost: Redis is away and %d jobs wait", req.id, MAX_HELD)
            return {"lost": str(exc)}
        log.warning("job %s waits in this process for Redis to come back: %s", req.id, exc)
        return {"held": str(exc)}

    def park_held(self) -> int:
        """Park the jobs held through a Redis outage (the liveness loop calls this once
        Redis answers again); returns how many were parked. Raises while Redis is away."""

        def claim(job_id: str, delivery: str, record: str) -> bool:
            return self.state.place_once(job_id, delivery, self._claim_ttl_s, record).first

        return self.held.park_all(claim, self.fail)

    def _place(self, req: JobRequest, started: int, score: float | None = None) -> dict[str, Any]:
        """Decide and carry out; ``score`` is set when a parked job is retried."""
        with self._placing:
            return self._place_now(req, started, score)

    def _place_now(self, req: JobRequest, started: int, score: float | None) -> dict[str, Any]:
        """Gather, decide, commit, send; park or refuse when that is the decision."""
        info = self.registry.info(req.model)
        default_ctx = self.settings.embed_num_ctx if req.kind == "embed" else self.settings.num_ctx
        num_ctx, warning = choose_num_ctx(req.options.num_ctx, default_ctx, info.context_length)
        config = runner_config(req, num_ctx, self.defaults)
        shape = self.shapes.of(info, config)
        prefix = job_key(req)
        affine = self.affinity.get(prefix) if prefix else None
        needs = job_needs(req, config, shape, score is not None, self.defaults, affine)
        order = score if score is not None else park_score(req, time.time())
        keep_alive_s = self.settings.keep_alive_s
        fields = partial(runner_fields, req.model, needs.config_key, config, shape, keep_alive_s)
        for _attempt in range(8):  # lost races against other placers: decide again
            now = self.clock.now()
            parked_models = LazySet(self.parked.models)
            snap = self.snapshots.snapshot(now, self.settings.device_ttl_s, parked_models)
            decision = decide(
                needs,
                snap,
                self.settings.placement_policy,
                now,
                self.settings.max_queue,
                self.settings.max_loaded_models,
            )
            placement_id = uuid.uuid4().hex[:12]
            match commit(decision, fields, self.ledger, snap, now, placement_id):
                case Assigned() as assigned:
                    placement = Placement(
                        id=placement_id,
                        runner_id=assigned.runner_id,
                        device_id=assigned.device_id,
                        device_ids=assigned.device_ids,
                        split_blocks=assigned.split_blocks,
                        n_gpu_layers=assigned.n_gpu_layers,
                        config=config,
                        warnings=[w for w in (warning, format_warning(req)) if w],
                        placement_ns=time.perf_counter_ns() - started,
                    )
                    if prefix:
                        self.affinity.put(prefix, assigned.runner_id)
                    decided = time.time()
                    outcome = self._send(req, placement, snap)
                    route = route_for(req, assigned, placement, snap, needs.config_key, warning)
                    hops = {"decided": decided, "sent": time.time()}
                    return dict(outcome, hops=hops, route=route)
                case Wait(reason):
                    if isinstance(decision, Park):
                        log.info("job %s parked: %s", req.id, reason)
                    self._park(req, order)
                case Refuse(code, reason):
                    if code == NoWorkers.code and time.monotonic() < self.grace_until:
                        self._park(req, order)  # Redis just came back: workers beat soon
                    raise error_from_code(code, reason)
        self._park(req, order)

    def _send(self, req: JobRequest, placement: Placement, snap: Snapshot) -> dict[str, Any]:
        """Send the job to its device: its record and its message in one step. When that
        step fails, or the job was swept from this process, the commit before it is undone;
        a step that ran after all (its answer was lost) leaves the job sent."""
        worker = snap.device_by_id[placement.device_id].worker
        record = SentJob(job=req, placement=placement, worker=worker, sent_at=self.clock.now())
        outcome = {"device": placement.device_id, "runner": placement.runner_id}
        try:
            queue, message = run_message(self.app, req, placement)
            if self.state.sent(record, queue, message):
                return outcome
        except Exception:
            if not self.state.undone(record):
                log.warning("job %s was sent, though its send's answer was lost", req.id)
                return outcome
            raise  # the job parks, or fails after repeated errors
        log.warning("job %s was put back by another placement process: left to it", req.id)
        self.state.undone(record)  # a runner made for it goes (or the recount takes it)
        raise SweptAway(req.id)

    def _park(self, req: JobRequest, score: float) -> NoReturn:
        self.parked.park(req, score)
        raise Parked(req.id)

    def fail_or_hold(self, job_id: str, model: str, exc: GgufqError) -> None:
        """:meth:`fail`, or, when Redis does not take it, keep it to write once it is back."""
        try:
            self.fail(job_id, model, exc)
        except Exception as away:
            log.warning("job %s's end waits for Redis (%s): %s", job_id, away, exc)
            self.held.hold_failure(job_id, model, exc)

    def fail(self, job_id: str, model: str, exc: GgufqError) -> None:
        """End a job that will never run: a final error chunk and a FAILURE result; then let
        go of it. Nothing when it was swept from this process: it is another's now."""
        if not job_id:
            return
        if not self.hands.ending(job_id):
            what = "job %s is another's to end (put back by another placement process, or sent)"
            log.warning(what, job_id)
            self.hands.hand_over(job_id)
            return
        final = error_chunk(model, job_id, exc)
        ended = publish_final(self.r, job_id, final, self.settings.stream_ttl_s, self.hands.streams)
        if ended is Appended.FENCED:  # its record says it runs, or ended: not ours to end
            log.warning("job %s's custody record refuses its end here: %s", job_id, exc)
        elif isinstance(exc, JobCancelled):
            self.app.backend.mark_as_revoked(job_id, reason=str(exc))
        else:
            self.app.backend.mark_as_failure(job_id, exc)
        self.hands.let_go(job_id)

    def recover_orphans(self) -> int:
        """Re-place or end the jobs of dropped devices (:meth:`Recovery.orphans`)."""
        return self.recovery.orphans()

    def _replace(self, req: JobRequest) -> None:
        score = park_score(req, min(req.submitted_at, time.time()))  # its place kept
        if "device" in self._attempt(req, time.perf_counter_ns(), score, errors=0, new=True):
            self.hands.hand_over(req.id)  # its send let go of it

    def cancel_parked(self, job_id: str) -> bool:
        """End a parked job that was asked to cancel; False if it is not parked here."""
        try:
            with self.held.takes():
                claimed = self.parked.claim(job_id)
        except GgufqError as exc:  # its record does not parse: it ends all the same
            self.fail_or_hold(job_id, "", exc)
            return True
        if claimed is None:
            return False
        self.fail_or_hold(job_id, claimed.job.model, cancelled_before_start(job_id))
        return True

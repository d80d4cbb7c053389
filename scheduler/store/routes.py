"""The fast path: a job whose runner is resident with a free slot goes from its client
straight to the runner's device queue, skipping placement's queue and its Celery hop.

Placement publishes a **route** for each shape of request it has placed (model, embedding
or not, the num_ctx and num_parallel the request asks for) while one runner serves that
shape. A client reads the route (cached for a second or two) and runs ``lua/fast_send.lua``,
which re-checks in Redis, atomically, what placement's decision would: the route still
names the runner, it is ready, it has a free slot, its device beats, and no job waits
(parked, or in placement's queues, which it must not overtake). Then it does what
placement does: takes the slot, claims the job's placement, records the job as sent (so
that the lost-message sweep and orphan recovery know it), pushes its Celery message,
counts the model's demand and notes the job's first hops, all in that one round trip.
Anything else, and the job takes the normal path. Jobs pinned to a device, asking for GPU
layers, loading replicas or re-placed never take it, nor does a model with several
replicas (placement's choice among them, by prefix affinity, stays with placement).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from pydantic import BaseModel, ConfigDict

from scheduler.cluster import DEMAND_TAU_S
from scheduler.errors import job_id_taken
from scheduler.protocol import JobRequest, Placement, RunnerConfig, SentJob
from scheduler.store import keys
from scheduler.store.cancel import queue_cancel
from scheduler.store.scripts import script

log = logging.getLogger(__name__)
ROUTE_TTL_S = 600  # a route not used for this long goes (each use renews it)
CACHE_S = 2.0  # how long a client trusts the route it read (the script checks it anyway)


class Route(BaseModel):
    """What placement published for one shape of request: the runner that serves it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    runner_id: str
    device_id: str
    worker: str
    config: RunnerConfig
    warnings: list[str] = []


def shape(req: JobRequest) -> str | None:
    """The shape of a request that decides its runner, or None for a job that only
    placement may place."""
    o = req.options
    if req.device or req.avoid or req.attempt or req.replicas or o.num_gpu != -1:
        return None
    if req.kind == "generate" and not req.prompt:
        return None  # a load or an unload: placement's
    kind = "embed" if req.kind == "embed" else "generate"
    return f"{req.model}|{kind}|{o.num_ctx or 0}|{o.num_parallel or 0}"


def publish_route(pipe: Any, req: JobRequest, route: Route | None) -> None:
    """Queue on ``pipe``: ``route`` now serves jobs shaped as ``req`` (None: no single
    runner does, so such jobs go through placement)."""
    name = shape(req)
    if name is None:
        return
    if route is None:
        pipe.delete(keys.route(name))
    else:
        pipe.set(keys.route(name), route.model_dump_json(), ex=ROUTE_TTL_S)


@dataclass(frozen=True)
class Attempt:
    """One fast-path send, ready to run: the script's keys and arguments, the placement it
    makes, and the claim that tells afterwards whether it ran."""

    name: str
    placement: Placement
    keys: list[str]
    args: list[Any]
    claim: bytes


class _Routes:
    """What both sides of the fast path share, without I/O: the cached routes, the script's
    arguments, the reading of its answer (``client``, sync or asyncio, is the sides')."""

    def __init__(
        self,
        client: Any,
        device_ttl_s: float,
        claim_ttl_s: int,
        stream_ttl_s: int,
        clock: Any = time.monotonic,
    ) -> None:
        self.r = client
        self._send = script(client, "fast_send")
        self.device_ttl_s, self.claim_ttl_s, self.stream_ttl_s = (
            device_ttl_s,
            claim_ttl_s,
            stream_ttl_s,
        )
        self.clock = clock
        self._routes: dict[str, tuple[float, bytes]] = {}  # shape → (until, route)

    def cached(self, name: str) -> bytes | None:
        found = self._routes.get(name)
        return found[1] if found is not None and found[0] > self.clock() else None

    def remember(self, name: str, raw: object) -> bytes | None:
        if not isinstance(raw, bytes):  # not kept: placement may publish it any moment
            return None
        self._routes[name] = (self.clock() + CACHE_S, raw)
        return raw

    def attempt(
        self,
        req: JobRequest,
        name: str | None,
        raw: bytes | None,
        message: Any,
        more_warnings: list[str] | None,
    ) -> Attempt | None:
        """What sending ``req`` by the route ``raw`` takes (None: no route, or one that
        does not parse)."""
        if name is None or raw is None:
            return None
        started = time.perf_counter_ns()
        try:
            route = Route.model_validate_json(raw)
        except ValueError:  # not a route (written by hand, or by another version)
            log.warning("ignoring the route for %s, which does not parse", name)
            self._routes.pop(name, None)
            return None
        placement = Placement(
            id=uuid.uuid4().hex[:12],
            runner_id=route.runner_id,
            device_id=route.device_id,
            config=route.config,
            warnings=[*route.warnings, *(more_warnings or [])],
            placement_ns=time.perf_counter_ns() - started,
        )
        queue, sending = message(placement)
        now = time.time()  # the client's: last use, demand and hops
        # sent_at 0.0 is stamped by the script on Redis's clock (the lost-send look's)
        record = SentJob(job=req, placement=placement, worker=route.worker, sent_at=0.0)
        claim = f"fast:{placement.id}"
        args = [
            raw,
            route.device_id,
            now,
            self.device_ttl_s,
            self.claim_ttl_s,
            req.submitted_at,
            claim,
            req.id,
            record.model_dump_json(),
            placement.id,
            self.stream_ttl_s,
            sending,
            ROUTE_TTL_S,
            req.model,
            DEMAND_TAU_S,
        ]
        job_keys = [
            keys.route(name),
            keys.runner(route.runner_id),
            keys.HEARTBEATS,
            keys.PARKED,
            keys.placement_queue("interactive"),
            keys.placement_queue("batch"),
            keys.job_submitted(req.id),
            keys.job_placed(req.id),
            keys.inflight(route.device_id),
            queue,
            keys.DEMAND,
            keys.job_hops(req.id),
        ]
        return Attempt(name, placement, job_keys, args, claim.encode())

    def outcome(self, req: JobRequest, attempt: Attempt, sent: int) -> Placement | None:
        if sent < 0:
            raise job_id_taken(req.id)
        if not sent:
            self._routes.pop(attempt.name, None)  # read it afresh next time
            return None
        return attempt.placement


class FastPath(_Routes):
    """A client's side of the fast path (one per client; safe across its threads)."""

    r: redis.Redis

    def route(self, name: str) -> bytes | None:
        return self.cached(name) or self.remember(name, self.r.get(keys.route(name)))

    def send(
        self, req: JobRequest, message: Any, more_warnings: list[str] | None = None
    ) -> Placement | None:
        """Send ``req`` to its runner's queue if the fast path holds, with
        ``message(placement)`` making its device queue and Celery message
        (celery_app.run_message) and ``more_warnings`` for the job (beside the route's);
        None when the normal path must place it. Raises InvalidRequest when the job id is
        taken."""
        name = shape(req)
        raw = None if name is None else self.route(name)
        attempt = self.attempt(req, name, raw, message, more_warnings)
        if attempt is None:
            return None
        try:
            sent = int(self._send(keys=attempt.keys, args=attempt.args))
        except redis.RedisError:
            # its reply was lost: the claim tells whether it ran (Redis away: this raises)
            sent = int(self.r.get(keys.job_placed(req.id)) == attempt.claim)
        return self.outcome(req, attempt, sent)


class AsyncFastPath(_Routes):
    """:class:`FastPath` on redis.asyncio (one per client, used from its event loop)."""

    r: redis.asyncio.Redis

    async def route(self, name: str) -> bytes | None:
        return self.cached(name) or self.remember(name, await self.r.get(keys.route(name)))

    async def send(
        self, req: JobRequest, message: Any, more_warnings: list[str] | None = None
    ) -> Placement | None:
        """See :meth:`FastPath.send`."""
        name = shape(req)
        raw = None if name is None else await self.route(name)
        attempt = self.attempt(req, name, raw, message, more_warnings)
        if attempt is None:
            return None
        try:
            try:
                sent = int(await self._send(keys=attempt.keys, args=attempt.args))
            except redis.RedisError:
                sent = int(await self.r.get(keys.job_placed(req.id)) == attempt.claim)
        except asyncio.CancelledError:
            # the caller left while the script ran, or while its claim was read after a
            # lost reply: a job it sent would have no reader
            await asyncio.shield(self._withdraw(req.id, attempt.claim))
            raise
        return self.outcome(req, attempt, sent)

    async def _withdraw(self, job_id: str, claim: bytes) -> None:
        """Cancel the job if this attempt sent it (best effort: Redis may be away)."""
        try:
            if await self.r.get(keys.job_placed(job_id)) == claim:
                pipe = self.r.pipeline(transaction=False)
                queue_cancel(pipe, job_id, self.stream_ttl_s)
                await pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not cancel job %s, sent as its submitter left: %s", job_id, exc)

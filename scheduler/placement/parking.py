"""Jobs that wait for memory or for a runner's slot, kept in Redis, retried in fair order
across tenants.

Within a tenant, interactive jobs come before batch jobs, and each class keeps its arrival
order, so one tenant's jobs for one model keep their order. A parked job is retried when
capacity may have freed (a runner unloaded, a job finished, a device joined), by whichever
placement process claims it first.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import redis

from scheduler.cluster import JobView
from scheduler.errors import GgufqError, InvalidRequest
from scheduler.fairness import fair_order
from scheduler.protocol import JobRequest, parse_request
from scheduler.store import keys
from scheduler.store.cancel import cancelled_by, watch_keys
from scheduler.store.hands import Hands, PutBack, Taken, TakeUnsure, parked_record
from scheduler.store.records import text
from scheduler.store.scripts import script

_BATCH_OFFSET = 1e12  # every batch job sorts after every interactive one


def park_score(req: JobRequest, now: float) -> float:
    return now + (_BATCH_OFFSET if req.priority == "batch" else 0.0)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claimed:
    job: JobRequest
    score: float
    errors: int  # unexpected failures of its earlier placements
    cancelled: bool = False  # asked to cancel (read with the claim)


class ParsedRecords:
    """Parked records as jobs, kept from when this process parked them or read them: a
    job's end reads its model's parked records, and parsing each (JSON, then the job's
    checks) was a third of what waking the next one cost. Keyed by the record's bytes (a
    record put back changed is parsed again). A record and its job take about ten times
    the record's bytes in memory (a chat of 5,000 short messages: 0.57 MB as JSON, 5.7 MB
    parsed), so at most ``limit_bytes`` of records are kept (about 256 MiB in all), the
    oldest let go first, and none larger than a tenth of that."""

    def __init__(self, limit_bytes: int = 24 << 20) -> None:
        self.limit_bytes, self._size = limit_bytes, 0
        self._jobs: dict[bytes, JobRequest | None] = {}

    def job(self, raw: bytes | None) -> JobRequest | None:
        """A parked record as a job; None when it is gone or does not parse (its claim
        fails it: one bad record must not stop the queue)."""
        if raw is None:
            return None
        if raw in self._jobs:
            return self._jobs[raw]
        try:
            job: JobRequest | None = JobRequest.model_validate(json.loads(raw)["job"])
        except (ValueError, KeyError, TypeError):
            job = None
        self.remember(raw, job)
        return job

    def remember(self, raw: bytes, job: JobRequest | None) -> None:
        if len(raw) > self.limit_bytes // 10 or raw in self._jobs:
            return
        while self._jobs and self._size + len(raw) > self.limit_bytes:
            oldest = next(iter(self._jobs))
            self._size -= len(oldest)
            del self._jobs[oldest]
        self._jobs[raw] = job
        self._size += len(raw)


class ParkedJobs:
    def __init__(self, client: redis.Redis, hands: Hands | None = None) -> None:
        self.r = client
        self._hands = hands
        self._parsed = ParsedRecords()
        self._of_models: Any = None  # lua/parked_of.lua, registered on first use

    @property
    def hands(self) -> Hands:
        """The jobs this placement process handles; made on first use (a reader that only
        lists parked jobs registers no scripts)."""
        if self._hands is None:
            self._hands = Hands(self.r)
        return self._hands

    def park(self, req: JobRequest, score: float, errors: int = 0) -> None:
        """Add (or put back, at its old place) a job that cannot run yet, and let go of it;
        ``errors`` counts the placements of it that failed unexpectedly (a broker error, a
        bug). Nothing when the job was swept from this process: it is another's now."""
        record = parked_record(req.model_dump(mode="json"), score, errors)
        done = self.hands.put_back("parked", req.id, record)
        self._parsed.remember(record.encode(), req)
        if done is PutBack.SWEPT:
            log.warning("job %s was put back by another placement process: left to it", req.id)
        elif done is PutBack.SENT:
            log.warning("job %s stays sent: its send step ran, what failed came after", req.id)

    def claim(self, job_id: str) -> Claimed | None:
        """Take a parked job out for a retry, in hand; None when another placer took it
        first. Raises InvalidRequest when its record does not parse (the job is out of the
        queue, still in hand: failing it lets go of it)."""
        raw, watched = self.hands.take_reading("parked", job_id, read=watch_keys(job_id))
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            req = parse_request(record["job"])
            errors = int(record.get("errors", 0))
            return Claimed(req, float(record["score"]), errors, cancelled_by(*watched))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"parked job {job_id}'s record cannot be read: {exc}") from None

    def ids(self, models: Collection[str] | None = None) -> list[str]:
        """Parked job ids in queue order; only those of ``models`` when given."""
        if models is not None:
            return [job_id for job_id, _raw in self._records(models)]
        return [text(i) for i in cast(list[bytes], self.r.zrange(keys.PARKED, 0, -1))]

    def _records(self, models: Collection[str] | None) -> list[tuple[str, bytes | None]]:
        """Parked job ids in queue order with their records; only those of ``models``
        when given (their indexes and records read in one step)."""
        if models is None:
            ids = self.ids()
            raws = cast(list[bytes | None], self.r.mget([keys.parked_job(i) for i in ids]))
            return list(zip(ids, raws, strict=True)) if ids else []
        if not models:
            return []
        if self._of_models is None:
            self._of_models = script(self.r, "parked_of")
        flat = self._of_models(
            keys=[keys.parked_of(m) for m in sorted(models)], args=[keys.parked_job("")]
        )
        scored = [(float(flat[n + 1]), text(flat[n]), flat[n + 2]) for n in range(0, len(flat), 3)]
        return [(job_id, raw) for _score, job_id, raw in sorted(scored, key=lambda s: s[:2])]

    def entries(
        self, passes: Mapping[str, float] | None = None, models: Collection[str] | None = None
    ) -> list[tuple[str, JobRequest | None]]:
        """Parked job ids in retry order, each with its job (None: its record does not
        parse, or it was just claimed; those first); only those of ``models`` when given.
        Retry order is fair across tenants (:func:`scheduler.fairness.fair_order`, weighted
        by the jobs' ``weight``, after what each tenant was served lately, ``passes``):
        interactive before batch within a tenant, and each class in arrival order."""
        records = self._records(models)
        if not records:
            return []
        jobs = [(job_id, self._parsed.job(raw)) for job_id, raw in records]
        readable = [(i, job) for i, job in jobs if job is not None]
        weights = {job.tenant: job.weight for _, job in readable}
        backlog = [(j.tenant, j.priority, n) for n, (_, j) in enumerate(readable)]
        order = fair_order(backlog, weights, passes)
        return [(i, job) for i, job in jobs if job is None] + [readable[n] for n in order]

    def jobs(self) -> list[JobRequest]:
        """Parked jobs in retry order."""
        return [job for _id, job in self.entries() if job is not None]

    def models(self) -> set[str]:
        """The models with parked jobs (their index: no parked record is read)."""
        return {text(m) for m in cast(list[bytes], self.r.hkeys(keys.PARKED_MODELS))}

    def listing(self) -> list[JobView]:
        """One row per parked job: position overall and within its model."""
        rows, per_model = [], Counter[str]()
        for position, job in enumerate(self.jobs(), 1):
            per_model[job.model] += 1
            rows.append(
                JobView(
                    id=job.id,
                    model=job.model,
                    priority=job.priority,
                    tenant=job.tenant,
                    state="parked",
                    position=position,
                    model_position=per_model[job.model],
                    submitted_at=job.submitted_at,
                )
            )
        return rows


class HeldJobs:
    """Jobs placement could neither place, park nor fail because Redis was away: kept in
    the placement process and parked once Redis answers, so that none is dropped."""

    def __init__(self, parked: ParkedJobs, limit: int) -> None:
        self.parked, self.limit = parked, limit
        # each with the token it is held in hand under (scheduler/store/hands.py)
        self._jobs: dict[str, tuple[JobRequest, float, int, str, str]] = {}
        self._orphans: dict[str, tuple[bytes, str]] = {}  # job id → its SentJob record, as read
        self._failures: dict[str, tuple[str, GgufqError, str]] = {}  # job id → model, error
        self._takes: dict[tuple[Taken, str], str] = {}  # (what, job id) → the take's token
        # held by the consumer's thread and the liveness loop's, parked by the latter: a job
        # held again while park_all runs must not be dropped with the entry it replaced.
        # park_all keeps it through its Redis calls, none of which waits on another lock.
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs) + len(self._orphans) + len(self._failures) + len(self._takes)

    def hold_take(self, unsure: TakeUnsure) -> None:
        """Keep the token of a take Redis did not answer: asked again with it by
        :meth:`park_all`, and what it took, if anything, put back in its queue."""
        with self._lock:
            self._takes[(unsure.what, unsure.job_id)] = unsure.token

    @contextmanager
    def takes(self) -> Iterator[None]:
        """Around taking parked jobs or orphans: a take Redis did not answer is held
        (:meth:`hold_take`) and raised on."""
        try:
            yield
        except TakeUnsure as unsure:
            self.hold_take(unsure)
            raise

    def hold_failure(self, job_id: str, model: str, error: GgufqError) -> None:
        """Keep a job's end (its error) that Redis did not take, whole or in part: written
        again, whole, by :meth:`park_all` (a final chunk twice is harmless, none is not)."""
        with self._lock:
            self._failures[job_id] = (model, error, self.parked.hands.hand_over(job_id))

    def hold_orphan(self, job_id: str, raw: bytes) -> None:
        """Keep an orphaned job's record taken from Redis (to re-place or end it) whose
        handling Redis interrupted; put back among the orphans by :meth:`park_all`."""
        with self._lock:
            self._orphans[job_id] = (raw, self.parked.hands.hand_over(job_id))

    def hold(self, req: JobRequest, score: float, errors: int, delivery: str = "") -> bool:
        """Keep a job (False when ``limit`` jobs wait already). ``delivery`` is set when its
        claim (a placement's ``place_once``) is still to be made."""
        token = self.parked.hands.hand_over(req.id)
        with self._lock:
            if len(self._jobs) >= self.limit:
                return False
            self._jobs[req.id] = (req, score, errors, delivery, token)
            return True

    def park_all(
        self,
        claim: Callable[[str, str, str], bool],
        fail: Callable[[str, str, GgufqError], None] = lambda *_: None,
    ) -> int:
        """Park the jobs held (raises while Redis is still away); a job whose claim
        ``claim(job_id, delivery, parked record)`` finds taken is placed by another delivery
        of it, and is let go. Returns how many were parked."""
        with self._lock:
            hands = self.parked.hands
            for job_id, (model, error, token) in list(self._failures.items()):
                hands.adopt(job_id, token)
                fail(job_id, model, error)
                del self._failures[job_id]
            for job_id, (raw, token) in list(self._orphans.items()):
                hands.adopt(job_id, token)
                hands.put_back("orphan", job_id, raw)
                del self._orphans[job_id]
            for (what, job_id), token in list(self._takes.items()):
                taken = hands.take(what, job_id, token)
                if taken is not None:
                    log.warning(
                        "putting %s job %s back: Redis went away as it was taken", what, job_id
                    )
                    hands.put_back(what, job_id, taken)
                del self._takes[(what, job_id)]
            parked = 0
            for job_id, (req, score, errors, delivery, token) in list(self._jobs.items()):
                hands.adopt(job_id, token)
                record = parked_record(req.model_dump(mode="json"), score, errors)
                if not delivery or claim(job_id, delivery, record):
                    self.parked.park(req, score, errors)
                    parked += 1
                else:
                    hands.hand_over(job_id)
                del self._jobs[job_id]
            if parked:
                log.warning("parked %d jobs held through a Redis outage", parked)
            return parked


class LazySet(Collection[str]):
    """A set read on first use: most placements never ask which models have parked jobs."""

    def __init__(self, read: Callable[[], set[str]]) -> None:
        self._read = read
        self._items: set[str] | None = None

    def _get(self) -> set[str]:
        if self._items is None:
            self._items = self._read()
        return self._items

    def __contains__(self, item: object) -> bool:
        return item in self._get()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

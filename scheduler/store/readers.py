"""Read-only views of the cluster for listings: devices, runners and jobs in flight as typed
records (``Client.devices()``, ``ps()``, ``jobs()``, the CLI, metrics, the local stack)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import redis
import redis.asyncio
from pydantic import ValidationError

from scheduler.cluster import CustodyView, DeviceView, JobView, RunnerView
from scheduler.protocol import SentJob
from scheduler.store import keys
from scheduler.store.clock import redis_now
from scheduler.store.records import decoded, device_view, runner_view, text

log = logging.getLogger(__name__)


class ClusterReader:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def devices(self) -> list[DeviceView]:
        ids = sorted(text(d) for d in self.r.smembers(keys.DEVICES))
        pipe = self.r.pipeline(transaction=False)
        for device_id in ids:
            pipe.hgetall(keys.device(device_id))
            pipe.hvals(keys.reservations(device_id))
        replies = pipe.execute()
        views = []
        for i, device_id in enumerate(ids):
            h = decoded(replies[2 * i])
            if h:
                views.append(device_view(device_id, h, sum(int(v) for v in replies[2 * i + 1])))
        return views

    def runners(self) -> list[RunnerView]:
        ids = sorted(text(r) for r in self.r.smembers(keys.RUNNERS))
        pipe = self.r.pipeline(transaction=False)
        for runner_id in ids:
            pipe.hgetall(keys.runner(runner_id))
        views = (runner_view(i, decoded(h)) for i, h in zip(ids, pipe.execute(), strict=True))
        return [v for v in views if v is not None]

    def job_counts(self) -> dict[str, int]:
        """Jobs not ended, by state (parked, queued, running), from the sizes of their
        keys: no record is read (a scrape must not parse every prompt in flight)."""
        device_ids = sorted(text(d) for d in self.r.smembers(keys.DEVICES))
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(keys.PARKED)
        pipe.hlen(keys.RUNNING)
        for device_id in device_ids:
            pipe.hlen(keys.inflight(device_id))
        parked, running, *sent = pipe.execute()
        queued = max(0, sum(sent) - int(running))
        return {"parked": int(parked), "queued": queued, "running": int(running)}

    def sent_jobs(self) -> list[JobView]:
        """Jobs sent to devices and not ended: running, or queued at their worker (with the
        position in their device's queue, in the order they were sent)."""
        device_ids = sorted(text(d) for d in self.r.smembers(keys.DEVICES))
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.RUNNING)
        for device_id in device_ids:
            pipe.hgetall(keys.inflight(device_id))
        running_raw, *per_device = pipe.execute()
        running = {text(k): float(v) for k, v in running_raw.items()}
        rows = []
        for device_id, records in zip(device_ids, per_device, strict=True):
            sent = sorted(_readable(records.values()), key=lambda r: r.sent_at)
            position = 0
            for record in sent:
                started = running.get(record.job.id)
                position += started is None
                rows.append(
                    JobView(
                        id=record.job.id,
                        model=record.job.model,
                        priority=record.job.priority,
                        tenant=record.job.tenant,
                        device=device_id,
                        state="running" if started is not None else "queued",
                        position=0 if started is not None else position,
                        submitted_at=record.job.submitted_at,
                        started_at=started,
                    )
                )
        return rows

    def custody(self, job_ids: list[str]) -> list[CustodyView | None]:
        """Each job's custody record; None for a job with none (never placed, or ended
        longer ago than its stream is kept)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job_custody(job_id))
        views: list[CustodyView | None] = []
        for job_id, raw in zip(job_ids, pipe.execute(), strict=True):
            h = decoded(raw)
            try:
                views.append(
                    CustodyView(
                        id=job_id,
                        state=h["state"],
                        holder=h.get("holder", ""),
                        epoch=int(h["epoch"]),
                        moved_at=float(h["at"]),
                    )
                )
            except (KeyError, ValueError):
                views.append(None)
        return views

    def alive_counts(self, ttl_s: float) -> tuple[int, int]:
        """(devices, placement services) that beat within the last ``ttl_s`` seconds of
        Redis's clock."""
        now = redis_now(self.r)
        pipe = self.r.pipeline(transaction=False)
        pipe.zcount(keys.HEARTBEATS, now - ttl_s, "+inf")
        pipe.zcount(keys.PLACEMENT_ALIVE, now - ttl_s, "+inf")
        devices, placement = pipe.execute()
        return int(devices), int(placement)


def _readable(raws: Iterable[bytes]) -> Iterator[SentJob]:
    """The records that parse; one that does not (written by hand, or by another version)
    is left out of listings rather than breaking them."""
    for raw in raws:
        try:
            yield SentJob.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("skipping an in-flight record that does not parse: %s", exc)


async def aread_runners(client: redis.asyncio.Redis) -> list[RunnerView]:
    """:meth:`ClusterReader.runners` on an asyncio client: on its connections, no thread."""
    ids = sorted(text(r) for r in await client.smembers(keys.RUNNERS))
    pipe = client.pipeline(transaction=False)
    for runner_id in ids:
        pipe.hgetall(keys.runner(runner_id))
    hashes = await pipe.execute()
    views = (runner_view(i, decoded(h)) for i, h in zip(ids, hashes, strict=True))
    return [v for v in views if v is not None]

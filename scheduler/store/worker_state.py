"""What a worker reads and writes in Redis: its devices and their heartbeats, the runners it
loads and unloads, the jobs it starts and ends, and the events that wake placement."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, cast

import redis

from scheduler.cluster import DeviceInfo
from scheduler.protocol import Placement, SentJob
from scheduler.store import keys
from scheduler.store.cancel import cancelled_by, watch_keys
from scheduler.store.placement_state import GONE_BEAT, reap
from scheduler.store.records import text
from scheduler.store.scripts import flatten, script
from scheduler.store.shards import Shards
from scheduler.store.streams import (
    Appended,
    chunk_call,
    claim_stream,
    outcome_of,
    pay,
    write_owed,
)


class WorkerState:
    def __init__(self, client: redis.Redis, streams: Shards[redis.Redis] | None = None) -> None:
        self.r = client
        self.streams = streams or Shards(client)  # where the jobs' streams live
        self._begin_unload = script(client, "begin_unload")
        self._release = script(client, "release")
        self._reap = script(client, "reap")
        self._update = script(client, "update_runner")
        self._touch = script(client, "touch")
        self._heartbeat = script(client, "heartbeat")
        self._start = script(client, "start")
        self._end = script(client, "end")

    # -- devices -------------------------------------------------------------------------
    def register_device(self, dev: DeviceInfo) -> None:
        """Register ``dev`` in full, its first beat stamped on Redis's clock."""
        fields: dict[str, str | int | float] = {
            "id": dev.id,
            "host": dev.host,
            "worker": dev.worker,
            "name": dev.name,
            "kind": dev.kind,
            "total": dev.total,
            "free": dev.free,
            "virtual": int(dev.virtual),
            "uuid": dev.uuid,
            "queue": keys.device_queue(dev.id),
        }
        pipe = self.r.pipeline()
        pipe.hset(keys.device(dev.id), mapping=cast(Any, fields))
        pipe.sadd(keys.DEVICES, dev.id)
        self._heartbeat(
            keys=[keys.DEVICES, keys.HEARTBEATS], args=[0, "", dev.id, dev.free], client=pipe
        )
        self._touch(keys=[keys.device(dev.id), keys.reservations(dev.id)], client=pipe)
        pipe.publish(keys.EVENTS, json.dumps({"event": "device_joined", "device": dev.id}))
        pipe.execute()

    def heartbeat(
        self, free_by_device: dict[str, int], failing: str = "", quiet_s: float = 0.0
    ) -> list[str]:
        """Beat for each device still registered, on Redis's clock, with the worker's
        failing loops ("" when healthy); returns the devices that are not registered
        (dropped). A beat that changes nothing else goes in the change log once its last
        logged beat is ``quiet_s`` old (lua/heartbeat.lua)."""
        flat: list[Any] = [quiet_s, failing]
        for device_id, free in free_by_device.items():
            flat += [device_id, free]
        missing = self._heartbeat(keys=[keys.DEVICES, keys.HEARTBEATS], args=flat)
        return [text(d) for d in missing]

    def deregister_devices(self, device_ids: list[str]) -> None:
        """A worker leaving cleanly: its runners and reservations go with it."""
        pipe = self.r.pipeline()  # expire these devices' heartbeats, then reap as usual
        for device_id in device_ids:
            pipe.hset(keys.device(device_id), "heartbeat", GONE_BEAT)
            pipe.zadd(keys.HEARTBEATS, {device_id: GONE_BEAT}, xx=True)
        pipe.execute()
        reap(self._reap, -GONE_BEAT / 2)  # only beats that old: the devices just let go of

    # -- runners ---------------------------------------------------------------------------
    def update_runner(self, runner_id: str, fields: dict[str, Any]) -> bool:
        return bool(self._update(keys=[keys.runner(runner_id)], args=flatten(fields)))

    def begin_unload(self, runner_id: str, force: bool = False) -> bool:
        return bool(self._begin_unload(keys=[keys.runner(runner_id)], args=[int(force)]))

    def runner_phase(self, runner_id: str) -> str | None:
        """loading, ready or unloading; None when its record is gone."""
        return self.runner_phases([runner_id])[runner_id]

    def runner_phases(self, runner_ids: list[str]) -> dict[str, str | None]:
        """:meth:`runner_phase` of each of ``runner_ids``, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for runner_id in runner_ids:
            pipe.hget(keys.runner(runner_id), "state")
        raws = pipe.execute()
        phases = zip(runner_ids, raws, strict=True)
        return {r: None if raw is None else text(raw) for r, raw in phases}

    def runner_in_flight(self, runner_id: str) -> int | None:
        """The jobs placement counts on a runner; None when its record is gone."""
        raw = self.r.hget(keys.runner(runner_id), "in_flight")
        return None if raw is None else int(raw)

    def runner_devices(self, runner_id: str) -> dict[str, int]:
        """Bytes reserved per device for a runner (empty when it has no record)."""
        raw = self.r.hget(keys.runner(runner_id), "devices")
        return {d: int(n) for d, n in json.loads(raw or "{}").items()}

    def release(self, runner_id: str, device_ids: list[str]) -> None:
        self._release(
            keys=[keys.RUNNERS, keys.runner(runner_id), *map(keys.reservations, device_ids)],
            args=[runner_id],
        )
        self.announce({"event": "runner_unloaded", "runner": runner_id})

    # -- jobs ------------------------------------------------------------------------------
    def start(
        self, device_id: str, job_id: str, placement_id: str, delivery: str, now: float
    ) -> bool | None:
        """Start a delivered job in one round trip (lua/start.lua): None when it is not this
        delivery's to run (re-placed after its device was dropped, or another delivery of the
        message has its one run), else whether it is already to be cancelled. ``delivery``
        is an id of this delivery, so that trying again after a lost reply still finds the
        run ours."""
        answer = self._start(
            keys=[
                keys.inflight(device_id),
                keys.job_custody(job_id),
                keys.RUNNING,
                *watch_keys(job_id),
            ],
            args=[job_id, placement_id, delivery, now],
        )
        if not int(answer[0]):
            return None
        _, flag, wanted, reader = answer
        return cancelled_by(flag, wanted, reader)

    def started(self, device_ids: list[str]) -> list[SentJob]:
        """The jobs recorded in flight on ``device_ids`` that are marked running (start.lua
        marks a job running and claims its run, in one step), in three round trips that
        read and parse only those records, not the queued ones' prompts; unreadable records
        are left to the device's reaping."""
        pipe = self.r.pipeline(transaction=False)
        for device_id in device_ids:
            pipe.hkeys(keys.inflight(device_id))
        ids = [[text(j) for j in found] for found in pipe.execute()]
        flat = [j for found in ids for j in found]
        if not flat:
            return []
        marks = dict(zip(flat, cast(list[Any], self.r.hmget(keys.RUNNING, flat)), strict=True))
        for device_id, found in zip(device_ids, ids, strict=True):
            pipe.hmget(keys.inflight(device_id), [j for j in found if marks[j] is not None] or [""])
        records = (SentJob.parse(raw) for values in pipe.execute() for raw in values if raw)
        return [record for record in records if record is not None]

    def job_holder(self, job_id: str) -> str | None:
        """Who holds the job now, as its custody record names it: the placement id it runs
        under, "" (orphaned, or ended unrun), a placement process (placing), or None (no
        record: Redis lost its data, or the job ended long ago)."""
        raw = self.r.hget(keys.job_custody(job_id), "holder")
        return None if raw is None else text(raw)

    def end(
        self,
        placement: Placement,
        job_id: str,
        last: tuple[int, dict[str, Any] | None],
        now: float,
        keep_alive_s: float | None,
        ttl_s: int,
        orphan: SentJob | None = None,
    ) -> tuple[Appended, int]:
        """A job's end in one round trip (lua/end.lua): its ``last`` chunk (seq, chunk; None
        writes none) fenced by its custody record's holder, its in-flight record and
        running mark gone (the mark stays when the job is another placement's now), its
        runner counting this placement off (``keep_alive_s`` None keeps the runner's), and
        a job handed back among the orphans as ``orphan`` (placement hears of it). Returns
        what became of the chunk and how many jobs the runner still counts (-1: gone)."""
        seq, chunk = last
        apart = self.streams.sharded and chunk is not None  # written on the stream's Redis
        chunk_keys, chunk_args = chunk_call(job_id, seq, chunk, ttl_s, placement.id)
        owed = ""
        if apart:  # owed there (ggufq:due:final) until written: the record moves first
            owed, chunk_args[2] = chunk_args[2], ""
        keep = "" if keep_alive_s is None else keep_alive_s
        appended, left = self._end(
            keys=[
                *chunk_keys,
                keys.RUNNING,
                keys.inflight(placement.device_id),
                keys.runner(placement.runner_id),
                keys.EVENTS,
                keys.ORPHANS,
                keys.job_custody(job_id),
            ],
            args=[
                *chunk_args,
                job_id,
                now,
                keep,
                placement.runner_id,
                "" if orphan is None else orphan.model_dump_json(),
                outcome_of(chunk),
                owed,
            ],
        )
        if apart and chunk is not None and Appended(int(appended)) is Appended.WRITTEN:
            # after the record: a reader that sees the last chunk finds the job ended; a
            # chunk its Redis does not take stays owed, for placement to write
            write = partial(write_owed, job_id=job_id, seq=seq, chunk=chunk, ttl_s=ttl_s)
            appended = pay(self.r, self.streams, job_id, partial(write, fence=placement.id))
            appended = Appended.WRITTEN if appended is None else appended
        return Appended(int(appended)), int(left)

    def claim_stream(self, job_id: str, placement_id: str) -> int | None:
        """A started run's claim on its job's stream where streams live apart (see
        :func:`scheduler.store.streams.claim_stream`), under the epoch its custody record
        names while it names this run; None when it names another (the job was taken from
        this run). 0 where streams do not live apart (the custody record fences there)."""
        if not self.streams.sharded:
            return 0
        stream = self.streams.of(job_id)
        for force in (False, True):
            holder, epoch = self.r.hmget(keys.job_custody(job_id), ["holder", "epoch"])
            if holder is not None and text(holder) != placement_id:
                return None
            found = claim_stream(stream, job_id, placement_id, int(epoch or 0), force)
            if found != -2:
                return found
            # a later epoch's claim or fence, though the record names this run still: a
            # control Redis restored from an older snapshot counts its epochs again
        return None

    def announce(self, event: dict[str, Any]) -> None:
        """Tell placement that capacity may have changed (wakes parked jobs)."""
        self.r.publish(keys.EVENTS, json.dumps(event))

"""Device, runner and reservation state in Redis: the I/O edge around the pure decision.

Reservations are taken and released only by the Lua scripts in ``scheduler/lua``, so any
number of placement processes and workers never over-commit a device.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, cast

import redis

from scheduler.cluster import DEMAND_TAU_S, DeviceInfo, DeviceState, RunnerState, Snapshot, decayed
from scheduler.store import keys


@cache
def _lua_source(name: str) -> str:
    folder = resources.files("scheduler.store").joinpath("lua")
    # every script logs the keys it changes (snapcache.py reads that log)
    return folder.joinpath("_changes.lua").read_text() + folder.joinpath(f"{name}.lua").read_text()


def _script(client: redis.Redis, name: str) -> Any:
    return client.register_script(_lua_source(name))


class ClusterState:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._reserve = _script(client, "reserve")
        self._assign = _script(client, "assign")
        self._finish = _script(client, "finish")
        self._begin_unload = _script(client, "begin_unload")
        self._release = _script(client, "release")
        self._reap = _script(client, "reap")
        self._update = _script(client, "update_runner")
        self._demand = _script(client, "demand")
        self._touch = _script(client, "touch")
        self._done_with = _script(client, "done_with")

    # -- devices -------------------------------------------------------------------------
    def register_device(self, dev: DeviceInfo, now: float) -> None:
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
            "heartbeat": now,
        }
        pipe = self.r.pipeline()
        pipe.hset(keys.device(dev.id), mapping=cast(Any, fields))
        pipe.sadd(keys.DEVICES, dev.id)
        pipe.zadd(keys.HEARTBEATS, {dev.id: now})
        self._touch(keys=[keys.device(dev.id), keys.reservations(dev.id)], client=pipe)
        pipe.publish(keys.EVENTS, json.dumps({"event": "device_joined", "device": dev.id}))
        pipe.execute()

    def heartbeat(self, free_by_device: dict[str, int], now: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        for device_id, free in free_by_device.items():
            pipe.hset(keys.device(device_id), mapping={"free": free, "heartbeat": now})
            pipe.zadd(keys.HEARTBEATS, {device_id: now})
        self._touch(keys=[keys.device(d) for d in free_by_device], client=pipe)
        pipe.execute()

    def deregister_devices(self, device_ids: list[str]) -> None:
        """A worker leaving cleanly: its runners and reservations go with it."""
        self.reap(now=float("inf"), device_ttl_s=0.0, only=device_ids)

    def reap(self, now: float, device_ttl_s: float, only: list[str] | None = None) -> list[str]:
        if only is not None:
            for device_id in only:  # expire these devices' heartbeats, then reap as usual
                self.r.hset(keys.device(device_id), "heartbeat", -1e18)
            now = 0.0
        dropped = self._reap(
            keys=[keys.DEVICES, keys.RUNNERS, keys.HEARTBEATS, keys.ORPHANS],
            args=[now, device_ttl_s],
        )
        return [d.decode() if isinstance(d, bytes) else d for d in dropped]

    # -- snapshot --------------------------------------------------------------------------
    def snapshot(self, now: float, device_ttl_s: float) -> Snapshot:
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(keys.DEVICES)
        pipe.smembers(keys.RUNNERS)
        pipe.zcard(keys.PARKED)
        pipe.hgetall(keys.DEMAND)
        device_ids, runner_ids, parked, demand_raw = pipe.execute()
        device_ids = sorted(_s(d) for d in device_ids)
        runner_ids = sorted(_s(r) for r in runner_ids)
        pipe = self.r.pipeline(transaction=False)
        for device_id in device_ids:
            pipe.hgetall(keys.device(device_id))
            pipe.hvals(keys.reservations(device_id))
        for runner_id in runner_ids:
            pipe.hgetall(keys.runner(runner_id))
        replies = pipe.execute()
        devices = []
        for i, device_id in enumerate(device_ids):
            h = _decode(replies[2 * i])
            if h and now - float(h.get("heartbeat", 0)) <= device_ttl_s:
                reserved = sum(int(v) for v in replies[2 * i + 1])
                devices.append(device_from_hash(device_id, h, reserved))
        alive = {d.id for d in devices}
        runners = []
        for runner_id, raw in zip(runner_ids, replies[2 * len(device_ids) :], strict=True):
            record = runner_from_hash(runner_id, _decode(raw))
            if record is not None and set(record.devices) <= alive:
                runners.append(record)
        demand = decayed_demand(_decode(demand_raw), now)
        return Snapshot(devices=devices, runners=runners, parked=int(parked), demand=demand)

    def count_request(self, model: str, now: float) -> None:
        self._demand(keys=[keys.DEMAND], args=[model, now, DEMAND_TAU_S])

    def alive_counts(self, now: float, ttl_s: float) -> tuple[int, int]:
        """(devices, placement services) that beat within the last ``ttl_s`` seconds."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zcount(keys.HEARTBEATS, now - ttl_s, "+inf")
        pipe.zcount(keys.PLACEMENT_ALIVE, now - ttl_s, "+inf")
        devices, placement = pipe.execute()
        return int(devices), int(placement)

    def placement_beat(self, name: str, now: float, ttl_s: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(keys.PLACEMENT_ALIVE, {name: now})
        pipe.zremrangebyscore(keys.PLACEMENT_ALIVE, "-inf", now - 10 * ttl_s)
        pipe.execute()

    def placement_gone(self, name: str) -> None:
        self.r.zrem(keys.PLACEMENT_ALIVE, name)

    def runner_records(self) -> list[dict[str, str]]:
        ids = sorted(_s(r) for r in self.r.smembers(keys.RUNNERS))
        pipe = self.r.pipeline(transaction=False)
        for runner_id in ids:
            pipe.hgetall(keys.runner(runner_id))
        return [dict(_decode(h), id=i) for i, h in zip(ids, pipe.execute(), strict=True) if h]

    def device_records(self) -> list[dict[str, str]]:
        ids = sorted(_s(d) for d in self.r.smembers(keys.DEVICES))
        pipe = self.r.pipeline(transaction=False)
        for device_id in ids:
            pipe.hgetall(keys.device(device_id))
            pipe.hvals(keys.reservations(device_id))
        replies = pipe.execute()
        rows = []
        for i in range(len(ids)):
            h = _decode(replies[2 * i])
            if h:
                h["reserved"] = str(sum(int(v) for v in replies[2 * i + 1]))
                rows.append(h)
        return rows

    # -- runners ---------------------------------------------------------------------------
    def reserve(
        self,
        runner_id: str,
        reservations: dict[str, int],
        fields: dict[str, Any],
        now: float,
        device_ttl_s: float,
    ) -> bool:
        """Create the runner (one job assigned) and reserve its memory on every device it
        spans, all or nothing.

        False when a device can no longer hold its part (another placer won the race).
        """
        device_ids = list(reservations)
        record = dict(fields, device_ids=",".join(device_ids), devices=json.dumps(reservations))
        record.update(state="loading", in_flight=1, last_used=now, expires_at=-1)
        device_keys = []
        for device_id in device_ids:
            device_keys += [keys.device(device_id), keys.reservations(device_id)]
        ok, _free = self._reserve(
            keys=[keys.RUNNERS, keys.runner(runner_id), *device_keys],
            args=[
                runner_id,
                now,
                device_ttl_s,
                len(device_ids),
                *reservations.values(),
                *_flatten(record),
            ],
        )
        return bool(ok)

    def assign(self, runner_id: str, now: float) -> bool:
        return bool(self._assign(keys=[keys.runner(runner_id)], args=[now]))

    def update_runner(self, runner_id: str, fields: dict[str, Any]) -> bool:
        return bool(self._update(keys=[keys.runner(runner_id)], args=_flatten(fields)))

    def finish(self, runner_id: str, now: float, keep_alive_s: float) -> int:
        return int(self._finish(keys=[keys.runner(runner_id)], args=[now, keep_alive_s]))

    def begin_unload(self, runner_id: str, force: bool = False) -> bool:
        return bool(self._begin_unload(keys=[keys.runner(runner_id)], args=[int(force)]))

    # -- jobs sent to devices -------------------------------------------------------------
    def sent(self, device_id: str, job_id: str, record: dict[str, Any]) -> None:
        """Record a job sent to a device's queue, before sending it: if the device is
        dropped, placement finds the job among the orphans."""
        self.r.hset(keys.inflight(device_id), job_id, json.dumps(record))

    def owns(self, device_id: str, job_id: str, placement_id: str) -> bool:
        """Whether this placement of the job is still the device's: not re-placed after the
        device was dropped (a re-placement, even onto the same device, has a new id)."""
        raw = self.r.hget(keys.inflight(device_id), job_id)
        return raw is not None and json.loads(raw)["placement"].get("id") == placement_id

    def started(self, job_id: str, now: float) -> None:
        self.r.hset(keys.RUNNING, job_id, now)

    def done_with(self, device_id: str, job_id: str, placement_id: str, pipe: Any) -> None:
        """Queue on ``pipe``: the job ended (its worker sends this with its counters)."""
        self._done_with(
            keys=[keys.RUNNING, keys.inflight(device_id)], args=[job_id, placement_id], client=pipe
        )

    def sent_jobs(self) -> list[dict[str, Any]]:
        """Jobs sent to devices and not ended: running, or queued at their worker (with the
        position in their device's queue, in the order they were sent)."""
        device_ids = sorted(_s(d) for d in self.r.smembers(keys.DEVICES))
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.RUNNING)
        for device_id in device_ids:
            pipe.hgetall(keys.inflight(device_id))
        running_raw, *per_device = pipe.execute()
        running = {_s(k): float(v) for k, v in running_raw.items()}
        rows = []
        for device_id, records in zip(device_ids, per_device, strict=True):
            jobs = sorted(
                (json.loads(v) for v in records.values()), key=lambda r: r.get("sent_at", 0)
            )
            position = 0
            for record in jobs:
                job = record["job"]
                started = running.get(job["id"])
                position += started is None
                rows.append(
                    {
                        "id": job["id"],
                        "model": job["model"],
                        "priority": job.get("priority", "interactive"),
                        "device": device_id,
                        "state": "running" if started is not None else "queued",
                        "position": 0 if started is not None else position,
                        "submitted_at": job.get("submitted_at", 0.0),
                        "started_at": started,
                    }
                )
        return rows

    def hand_back(self, job_id: str, record: dict[str, Any]) -> None:
        """A worker gives a job back to placement (its device could not load the model)."""
        pipe = self.r.pipeline()
        pipe.hset(keys.ORPHANS, job_id, json.dumps(record))
        pipe.publish(keys.EVENTS, json.dumps({"event": "handed_back", "job": job_id}))
        pipe.execute()

    def orphans(self) -> list[str]:
        return [_s(j) for j in self.r.hkeys(keys.ORPHANS)]

    def claim_orphan(self, job_id: str) -> dict[str, Any] | None:
        """Take an orphan to handle it; None when another placement process took it."""
        pipe = self.r.pipeline()
        pipe.hget(keys.ORPHANS, job_id)
        pipe.hdel(keys.ORPHANS, job_id)
        raw, removed = pipe.execute()
        return json.loads(raw) if raw and removed else None

    def announce(self, event: dict[str, Any]) -> None:
        """Tell placement that capacity may have changed (wakes parked jobs)."""
        self.r.publish(keys.EVENTS, json.dumps(event))

    def release(self, runner_id: str, device_ids: list[str]) -> None:
        self._release(
            keys=[keys.RUNNERS, keys.runner(runner_id), *map(keys.reservations, device_ids)],
            args=[runner_id],
        )
        self.announce({"event": "runner_unloaded", "runner": runner_id})


def device_from_hash(device_id: str, h: dict[str, str], reserved: int) -> DeviceState:
    return DeviceState(
        id=device_id,
        worker=h["worker"],
        queue=h["queue"],
        kind=h["kind"],  # type: ignore[arg-type]
        total=int(h["total"]),
        reported_free=int(h["free"]),
        reserved=reserved,
    )


def decayed_demand(raw: dict[str, str], now: float) -> dict[str, float]:
    """The demand hash (model → "count:time") as counts decayed to ``now``."""
    demand = {}
    for model, value in raw.items():
        score, last = value.split(":")
        demand[model] = decayed(float(score), float(last), now)
    return demand


def runner_from_hash(runner_id: str, h: dict[str, str]) -> RunnerState | None:
    if not h or "model" not in h:
        return None
    return RunnerState(
        id=runner_id,
        model=h["model"],
        config_key=h.get("config_key", ""),
        devices={k: int(v) for k, v in json.loads(h.get("devices", "{}")).items()},
        state=h.get("state", "loading"),  # type: ignore[arg-type]
        in_flight=int(h.get("in_flight", 0)),
        expires_at=float(h.get("expires_at", -1)),
        last_used=float(h.get("last_used", 0)),
        num_parallel=int(h.get("num_parallel", 1)),
        n_gpu_layers=int(h.get("n_gpu_layers", -1)),
    )


def _flatten(fields: dict[str, Any]) -> list[Any]:
    flat: list[Any] = []
    for key, value in fields.items():
        flat += [key, value]
    return flat


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(h: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in h.items()}

"""A placement process's copy of device and runner state, kept current from the change log.

Reading every device and runner hash for each placement costs O(cluster) round-trip data
(about 280 ms with 1,000 devices and 5,000 runners). Every Lua script and heartbeat logs
the keys it changes to a numbered stream (``lua/_changes.lua``); this cache reads only the
entries since its last read and refetches those keys, and keeps the decision's indexes up
to date as runners change. A gap in the numbers (the stream was trimmed, or Redis restarted
empty) makes it reload everything. It may be a moment behind other placers, which is safe:
the reservation scripts re-check memory atomically, and a lost race means deciding again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any, cast

import redis

from scheduler.cluster import (
    DeviceState,
    RunnerState,
    Snapshot,
    eviction_order,
    is_idle,
    is_live,
)
from scheduler.placement.alive import AliveDevices
from scheduler.store import keys
from scheduler.store.records import (
    decoded,
    demand_of,
    device_from_hash,
    runner_from_hash,
    text,
)
from scheduler.store.scripts import script

_DEVICE, _RESV, _RUNNER = keys.device(""), keys.reservations(""), keys.runner("")
MAX_CHANGES = 10_000  # log entries one look reads; more are read in further looks


class SnapshotCache:
    """Not thread-safe: one caller at a time (PlacementService holds its placing lock).

    Two threads reading the change log at once see each other's entries as gaps, reload,
    and one can find the cache cleared mid-read: a snapshot without devices.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._n = -1  # number of the last change applied; -1 = nothing loaded yet
        self._last_id: bytes | str = "0-0"
        self._hashes: dict[str, dict[str, str]] = {}  # device id → its hash
        self._reserved: dict[str, int] = {}
        self._devices: dict[str, DeviceState] = {}
        self._beats: dict[str, float] = {}
        self._runners: dict[str, RunnerState] = {}
        self._by_model: dict[str, dict[str, RunnerState]] = {}
        self._counts: dict[str, int] = {}
        self._idle: dict[str, dict[str, RunnerState]] = {}
        self.reloads = 0
        self._alive = AliveDevices(self._devices, self._beats)
        self._look: Any = None  # lua/changes_since.lua, registered on first use

    def snapshot(
        self, now: float, device_ttl_s: float, parked_models: Collection[str] = frozenset()
    ) -> Snapshot:
        """The current state; its indexes are views valid until the next call."""
        try:
            parked, touched = self._catch_up()
        except BaseException:
            self._n = -1  # the log was read past what this failed to fetch: reload next time
            raise
        alive = self._alive
        if touched is not None and alive.lapses_by(now):
            touched |= self._beats_now(now, device_ttl_s)
        alive.update(now, device_ttl_s, touched)
        demand = DecayedDemand(self.r, now)
        runners = list(self._runners.values())
        snap = Snapshot(list(alive.by_id.values()), runners, int(parked), demand, parked_models)
        # cached_property stores in the instance dict: supply the indexes ready-made
        live = _LiveByModel(self._by_model, alive.by_id)
        snap.__dict__.update(
            live_by_model=live,
            all_live_by_model=_LiveByModel(self._by_model, None),
            counts=dict(self._counts),
            idle_by_device=_IdleByDevice(self._idle, demand, live),
            device_by_id=alive.by_id,
            by_free=alive.by_free(),
            largest_total=alive.largest_total,
        )
        return snap

    def _beats_now(self, now: float, ttl_s: float) -> set[str]:
        """A beat that changed nothing reaches this cache a third of the TTL apart at most
        (lua/heartbeat.lua), so a cached beat may be older than the device's: before a
        device is judged dead on it, its beat is read from ggufq:heartbeats, where every
        beat goes and the reap judges it. The devices whose beat was newer."""
        lapsed = [d for d in self._devices if now - self._beats.get(d, -float("inf")) > ttl_s]
        if not lapsed:
            return set()
        fresh = set()
        for device_id, beat in zip(lapsed, self.r.zmscore(keys.HEARTBEATS, lapsed), strict=True):
            if beat is not None and float(beat) > self._beats.get(device_id, -float("inf")):
                self._beats[device_id] = float(beat)
                fresh.add(device_id)
        return fresh

    # -- change log ------------------------------------------------------------------------
    def _catch_up(self) -> tuple[int, set[str] | None]:
        """Take in what changed since the last look (the log and the keys it names, read in
        one step, MAX_CHANGES entries at a time), or reload; the parked count and the
        devices touched (None: all, reloaded)."""
        if self._look is None:
            self._look = script(self.r, "changes_since")
        touched: set[str] = set()
        while True:
            read_log = int(self._n >= 0)  # a first look reloads: no entry read for nothing
            args = [self._last_id, MAX_CHANGES, read_log]
            counter, parked, entries, *fetched = self._look(keys=[], args=args)
            changed = self._changed_keys(int(counter or 0), entries)
            if changed is None:
                self._reload()
                return int(parked), None
            if changed:
                read = [(text(k), reply) for k, reply in fetched]
                touched |= self._apply([(k, _as_reply(k, reply)) for k, reply in read])
            if len(entries) < MAX_CHANGES:  # the log is read to its end
                return int(parked), touched

    def _changed_keys(self, counter: int, entries: Any) -> set[str] | None:
        """The keys changed since the last read, or None when it must reload."""
        if self._n < 0 or counter < self._n:
            return None  # first read, or Redis lost its data
        records = entries or []
        if counter > self._n and not records:
            return None  # entries were trimmed before we read them
        changed, n = set(), self._n
        for entry_id, flat in records:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            number = int(fields[b"n"])
            if number != n + 1:
                return None
            n = number
            changed.add(fields[b"k"].decode())
            self._last_id = entry_id
        self._n = n
        return changed

    def _reload(self) -> None:
        self.reloads += 1
        pipe = self.r.pipeline(transaction=False)
        pipe.xrevrange(keys.CHANGES, count=1)
        pipe.get(keys.CHANGES_N)
        pipe.smembers(keys.DEVICES)
        pipe.smembers(keys.RUNNERS)
        last, counter, device_ids, runner_ids = pipe.execute()
        # changes logged after this point are read next time; refetching is idempotent
        if last:
            self._last_id, self._n = last[0][0], int(last[0][1][b"n"])
        else:
            self._last_id, self._n = "0-0", int(counter or 0)
        for store in (self._hashes, self._reserved, self._devices, self._beats, self._runners):
            store.clear()
        for index in (self._by_model, self._counts, self._idle):
            index.clear()
        wanted = {keys.device(text(d)) for d in device_ids}
        wanted |= {keys.reservations(text(d)) for d in device_ids}
        wanted |= {keys.runner(text(r)) for r in runner_ids}
        self._fetch(wanted)

    def _fetch(self, changed: set[str]) -> set[str]:
        """Read the ``changed`` keys again; returns the devices they touched."""
        ordered = sorted(changed)
        pipe = self.r.pipeline(transaction=False)
        for key in ordered:
            if key.startswith(_RESV):
                pipe.hvals(key)
            else:
                pipe.hgetall(key)
        return self._apply(list(zip(ordered, pipe.execute(), strict=True)))

    def _apply(self, read: list[tuple[str, Any]]) -> set[str]:
        """Take in keys read again (a hash as a dict, reservations as their values);
        returns the devices they touched."""
        touched: set[str] = set()
        for key, reply in read:
            if key.startswith(_RESV):
                device_id = key.removeprefix(_RESV)
                self._reserved[device_id] = sum(int(v) for v in reply)
                touched.add(device_id)
            elif key.startswith(_DEVICE):
                device_id = key.removeprefix(_DEVICE)
                self._hashes[device_id] = decoded(reply)
                touched.add(device_id)
            elif key.startswith(_RUNNER):
                runner_id = key.removeprefix(_RUNNER)
                self._drop_runner(runner_id)
                record = runner_from_hash(runner_id, decoded(reply))
                if record is not None:
                    self._add_runner(record)
        for device_id in touched:
            self._rebuild_device(device_id)
        return touched

    def _rebuild_device(self, device_id: str) -> None:
        h = self._hashes.get(device_id)
        if not h or "total" not in h:
            for store in (self._hashes, self._reserved, self._devices, self._beats):
                store.pop(device_id, None)
            return
        self._devices[device_id] = device_from_hash(device_id, h, self._reserved.get(device_id, 0))
        self._beats[device_id] = float(h.get("heartbeat", 0))

    # -- indexes (the same rules as Snapshot's own, kept current one runner at a time) ----
    def _add_runner(self, runner: RunnerState) -> None:
        self._runners[runner.id] = runner
        if is_live(runner):
            self._by_model.setdefault(runner.model, {})[runner.id] = runner
            for device_id in runner.devices:
                self._counts[device_id] = self._counts.get(device_id, 0) + 1
        if is_idle(runner):
            for device_id in runner.devices:
                self._idle.setdefault(device_id, {})[runner.id] = runner

    def _drop_runner(self, runner_id: str) -> None:
        old = self._runners.pop(runner_id, None)
        if old is None:
            return
        if is_live(old):
            _discard(self._by_model, old.model, runner_id)
            for device_id in old.devices:
                self._counts[device_id] -= 1
                if not self._counts[device_id]:
                    del self._counts[device_id]
        if is_idle(old):
            for device_id in old.devices:
                _discard(self._idle, device_id, runner_id)


def _as_reply(key: str, reply: list[bytes]) -> Any:
    """A key read by lua/changes_since.lua as redis-py gives it: a hash's flat fields and
    values as a dict; a device's reservations (their values) as they are."""
    if key.startswith(_RESV):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


class DecayedDemand(Mapping[str, float]):
    """The demand hash as decayed counts, read only when a decision looks one up (only an
    eviction does: the hash holds every model ever asked for, and reading it whole for
    each job cost more than the rest of the snapshot), and decoded only for the models
    looked up."""

    def __init__(self, client: redis.Redis, now: float) -> None:
        self._client, self._now = client, now
        self._read: dict[bytes, bytes] | None = None
        self._decoded: dict[str, float] = {}  # an eviction looks a model up many times

    @property
    def _raw(self) -> dict[bytes, bytes]:
        if self._read is None:
            self._read = cast(dict[bytes, bytes], self._client.hgetall(keys.DEMAND))
        return self._read

    def __getitem__(self, model: str) -> float:
        found = self._decoded.get(model)
        if found is None:
            found = demand_of(model, self._raw[model.encode()], self._now)
            if found is None:  # unreadable: as if never asked for
                raise KeyError(model)
            self._decoded[model] = found
        return found

    def __iter__(self) -> Iterator[str]:  # the models a lookup finds, as a full read's
        return (model for model in (k.decode() for k in self._raw) if model in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _LiveByModel(Mapping[str, list[RunnerState]]):
    """Live runners per model, on the ``alive`` devices only (None: on any device)."""

    def __init__(
        self, index: dict[str, dict[str, RunnerState]], alive: Mapping[str, DeviceState] | None
    ) -> None:
        self._index, self._alive = index, alive

    def __getitem__(self, model: str) -> list[RunnerState]:
        alive, runners = self._alive, list(self._index[model].values())
        if alive is not None:
            runners = [r for r in runners if all(d in alive for d in r.devices)]
        if not runners:
            raise KeyError(model)
        return runners

    def __iter__(self) -> Iterator[str]:  # the models a lookup finds, as a full read's
        return (model for model in self._index if model in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _IdleByDevice(Mapping[str, list[RunnerState]]):
    def __init__(
        self,
        index: dict[str, dict[str, RunnerState]],
        demand: DecayedDemand,
        live_by_model: Mapping[str, list[RunnerState]],
    ) -> None:
        # idle replicas first, as a full read ranks them (Snapshot.idle_by_device)
        self._index, self._order = index, eviction_order(demand, live_by_model)

    def __getitem__(self, device_id: str) -> list[RunnerState]:
        return sorted(self._index[device_id].values(), key=self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _discard(index: dict[str, dict[str, RunnerState]], key: str, runner_id: str) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.pop(runner_id, None)
        if not bucket:
            del index[key]

"""The alive devices of the snapshot cache, kept current one changed device at a time.

A placement used to walk every device for each job: which beat within the TTL, which is
the largest, which have room (about 1 ms a job with 1,000 devices). This index keeps the
alive devices by id and in :func:`~scheduler.cluster.free_order`, and updates only the
devices a change touched; everything is recomputed when a device joins or leaves the
alive set, or when the soonest beat it knows of could have lapsed. Pure: the caller
passes the devices, their beats and ``now``.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import overload

from scheduler.cluster import DeviceState, free_order

FreeKey = tuple[int, int, str]


class AliveDevices:
    """Over the snapshot cache's own ``devices`` and their ``beats`` (kept current by it)."""

    def __init__(self, devices: Mapping[str, DeviceState], beats: Mapping[str, float]) -> None:
        self._devices, self._beats = devices, beats
        self.by_id: dict[str, DeviceState] = {}
        self._keys: list[FreeKey] = []  # free_order of each alive device, sorted
        self._key_of: dict[str, FreeKey] = {}
        self.largest_total = 0
        self._ttl_s: float | None = None
        self._until = -float("inf")  # no alive device's beat lapses before this
        self._at = float("inf")  # the now of the last recompute

    def update(self, now: float, ttl_s: float, touched: Collection[str] | None) -> None:
        """Bring the index up to ``now``; ``touched`` names the devices changed since the
        last call (None: anything may have changed). A clock set back since the last
        recompute (a resync) may bring a device that had just lapsed back: recompute."""
        if touched is None or ttl_s != self._ttl_s or not self._at <= now <= self._until:
            self._recompute(now, ttl_s)
            return
        for device_id in touched:
            device = self._devices.get(device_id)
            beat = self._beats.get(device_id, -float("inf"))
            alive = device is not None and now - beat <= ttl_s
            old = self.by_id.get(device_id)
            if alive != (old is not None) or (
                device is not None and old is not None and device.total != old.total
            ):
                self._recompute(now, ttl_s)  # joined, left, or re-registered
                return
            if device is None or old is None:
                continue  # dead before and after
            self.by_id[device_id] = device  # same place in the order of ids
            self._until = min(self._until, beat + ttl_s)
            new_key = free_order(device)
            if new_key != self._key_of[device_id]:
                del self._keys[bisect.bisect_left(self._keys, self._key_of[device_id])]
                bisect.insort(self._keys, new_key)
                self._key_of[device_id] = new_key

    def lapses_by(self, now: float) -> bool:
        """Whether an alive device's beat, as last known, may have lapsed by ``now``."""
        return now > self._until

    def _recompute(self, now: float, ttl_s: float) -> None:
        beats = self._beats
        alive = {
            i: d for i, d in self._devices.items() if now - beats.get(i, -float("inf")) <= ttl_s
        }
        self.by_id = alive
        self._key_of = {i: free_order(d) for i, d in alive.items()}
        self._keys = sorted(self._key_of.values())
        self.largest_total = max((d.total for d in alive.values()), default=0)
        self._ttl_s, self._at = ttl_s, now
        self._until = min((beats[i] + ttl_s for i in alive), default=float("inf"))

    def by_free(self) -> Sequence[DeviceState]:
        """The alive devices in free_order; a view valid until the next update."""
        return _ByFree(self._keys, self.by_id)


class _ByFree(Sequence[DeviceState]):
    def __init__(self, keys: list[FreeKey], by_id: Mapping[str, DeviceState]) -> None:
        self._keys, self._by_id = keys, by_id

    @overload
    def __getitem__(self, index: int) -> DeviceState: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[DeviceState]: ...

    def __getitem__(self, index: int | slice) -> DeviceState | Sequence[DeviceState]:
        if isinstance(index, slice):
            return [self._by_id[k[2]] for k in self._keys[index]]
        return self._by_id[self._keys[index][2]]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[DeviceState]:
        return (self._by_id[k[2]] for k in self._keys)

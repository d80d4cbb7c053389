"""Redis's clock, the one that judges liveness, read from a host whose own clock is off."""

from __future__ import annotations

import time

import redis

from scheduler.cluster import DeviceInfo
from scheduler.store import keys
from scheduler.store.clock import RedisClock, redis_now
from scheduler.store.placement_state import PlacementState
from scheduler.store.worker_state import WorkerState


def test_a_host_clock_far_off_is_moved_onto_redis_clock(db: redis.Redis) -> None:
    late = RedisClock(db, local=lambda: time.time() - 3600)
    assert abs(late.now() - redis_now(db)) > 3000  # before its first sync: its own clock
    offset = late.sync()
    assert abs(offset - 3600) < 1.0
    assert abs(late.now() - redis_now(db)) < 1.0


def test_beats_are_stamped_by_redis_whatever_the_caller(db: redis.Redis) -> None:
    device = DeviceInfo("vgpu:h:0", "h", "w@h", "v", "vgpu", 1 << 30, 1 << 30, True)
    workers, placement = WorkerState(db), PlacementState(db)
    before = redis_now(db)
    workers.register_device(device)
    assert workers.heartbeat({device.id: 1 << 29}) == []
    beat = placement.placement_beat("p", ttl_s=5)
    after = redis_now(db)
    stamped = float(db.hget(keys.device(device.id), "heartbeat") or 0)
    # Lua writes numbers with 14 digits: a tenth of a millisecond
    assert before - 1e-3 <= stamped <= after + 1e-3 and before - 1e-3 <= beat <= after + 1e-3
    assert abs((db.zscore(keys.HEARTBEATS, device.id) or 0) - stamped) < 1e-3
    assert abs((db.zscore(keys.PLACEMENT_ALIVE, "p") or 0) - beat) < 1e-3

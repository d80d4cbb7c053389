"""A worker's unload when Redis drops a reply: against a real Redis (database 1), with a
recording fake of the runner (the part of a runner an unload touches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.gguf.registry import Registry
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.placement_state import PlacementState
from tests.test_state import GIB, ended, vgpu
from workers.runtime import WorkerRuntime


@dataclass
class FakeRunner:
    id: str
    device_ids: list[str]
    closed: list[int] = field(default_factory=list)
    keep_alive_s: float = 300.0

    def close(self) -> None:
        self.closed.append(1)


def test_an_unload_whose_reply_redis_lost_is_finished_on_the_next_try(
    db: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = vgpu(0)
    runtime = WorkerRuntime(Settings(), db, [device], Registry(tmp_path))
    runtime.state.register_device(device)
    assert PlacementState(db).reserve("r", "p1", {device.id: GIB}, {"model": "m"}, 100.0, 10)
    assert ended(runtime.state, "j") == 0
    runner = FakeRunner("r", [device.id])
    runtime.runners["r"] = runner  # type: ignore[assignment]
    begin = runtime.state.begin_unload

    def reply_lost(*args: Any, **kwargs: Any) -> bool:
        begin(*args, **kwargs)  # Redis marks it unloading ...
        raise redis.ConnectionError("Connection reset by peer")  # ... and the reply is lost

    monkeypatch.setattr(runtime.state, "begin_unload", reply_lost)
    with pytest.raises(redis.ConnectionError):
        runtime._unload("r")
    monkeypatch.undo()
    assert db.hget(keys.runner("r"), "state") == b"unloading"
    assert runtime._unload("r")  # its own earlier try: carried through, not refused
    assert runner.closed == [1]
    assert not db.exists(keys.runner("r")) and db.hlen(keys.reservations(device.id)) == 0
    runtime.chunks.close()

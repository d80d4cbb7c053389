"""What :func:`scheduler.placement.decision.decide` answers: route to a runner, load a new
one, evict idle runners, park, or refuse with a reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Route:
    runner_id: str
    device_id: str


@dataclass(frozen=True)
class Load:
    device_id: str
    bytes: int
    n_gpu_layers: int = -1  # -1 = the whole model on the device
    # a model split over several GPUs of one worker: device → (bytes, blocks), in layer order
    split: tuple[tuple[str, int, int], ...] = ()

    @property
    def reservations(self) -> dict[str, int]:
        if not self.split:
            return {self.device_id: self.bytes}
        return {device_id: nbytes for device_id, nbytes, _blocks in self.split}


@dataclass(frozen=True)
class Evict:
    runner_ids: list[str]


@dataclass(frozen=True)
class Park:
    reason: str


@dataclass(frozen=True)
class Refuse:
    code: Literal["no_capacity", "server_busy", "no_workers", "invalid_request", "load_failed"]
    reason: str
    per_device: dict[str, str] = field(default_factory=dict)


Decision = Route | Load | Evict | Park | Refuse


def server_busy(parked: int, max_queue: int) -> Refuse:
    return Refuse(
        "server_busy",
        f"server busy: {parked} jobs already wait for memory (max_queue {max_queue}); "
        "retry later or raise GGUFQ_MAX_QUEUE",
    )


def behind_parked(model: str, parked: int, max_queue: int) -> Park | Refuse:
    if parked >= max_queue:
        return server_busy(parked, max_queue)
    return Park(f"earlier jobs for {model!r} are waiting")


def runners_full(model: str, runners: int, parked: int, max_queue: int) -> Park | Refuse:
    """Every runner of ``model`` holds as many jobs as it may queue: wait in the parked
    queue, where jobs are retried in fair order across tenants."""
    if parked >= max_queue:
        return server_busy(parked, max_queue)
    return Park(
        f"the {runners} runner(s) of {model!r} are full (every slot busy and their queues "
        "at queue_depth) and no replica can be added"
    )

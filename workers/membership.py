"""This worker's devices in Redis: registered at start (after reaping what a predecessor
under the same ids left), kept alive by a heartbeat that also reports the worker's failing
loops, and registered again whenever placement dropped them. Beats are stamped on Redis's
clock: this host's own may be off by any amount."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from scheduler.cluster import DeviceInfo
from scheduler.loops import LoopHealth
from scheduler.settings import Settings
from scheduler.store.worker_state import WorkerState
from workers.devices import reported_free

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        state: WorkerState,
        devices: list[DeviceInfo],
        health: LoopHealth,
        settings: Settings,
        on_dropped: Callable[[set[str]], None],
    ) -> None:
        self.state, self.devices, self.health = state, devices, health
        self.interval_s = settings.heartbeat_interval_s
        # a beat that changed nothing reaches placement's cached view this far apart (it
        # reads ggufq:heartbeats before it judges a device dead on that view)
        self.quiet_s = settings.device_ttl_s / 3
        self.on_dropped = on_dropped  # let go of what placement took back with the devices

    def join(self) -> None:
        """Register every device; a predecessor under these ids (restarted within the TTL)
        left runners, reservations and jobs: they go first, so that placement re-places or
        fails those jobs and no phantom runner holds memory."""
        self.state.deregister_devices([d.id for d in self.devices])
        self._register(self.devices)

    def beat(self) -> None:
        # a loop counts as failing after three heartbeats without a success
        failing = self.health.describe(time.monotonic(), 3 * self.interval_s, "heartbeat")
        missing = set(self.state.heartbeat(reported_free(self.devices), failing, self.quiet_s))
        if missing:
            log.warning(
                "devices %s are no longer registered (this worker stalled past "
                "GGUFQ_DEVICE_TTL_S, or Redis lost its data): registering them again",
                ", ".join(sorted(missing)),
            )
            self.on_dropped(missing)
            self._register([d for d in self.devices if d.id in missing])

    def leave(self) -> None:
        self.state.deregister_devices([d.id for d in self.devices])

    def _register(self, devices: list[DeviceInfo]) -> None:
        for dev in devices:
            self.state.register_device(dev)

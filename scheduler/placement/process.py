"""The placement process: a Celery worker that takes jobs from the placement queues and
places each (one at a time), beside two background loops: liveness (its own heartbeat,
dropping silent devices, re-placing their jobs) and the parked-job waker.

``ggufq placement`` runs it, as does ``python -m scheduler.placement.process``.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

import redis
from celery import signals

from scheduler.loops import LoopHealth, start_loop
from scheduler.placement.metrics import serve_metrics
from scheduler.placement.service import PlacementService
from scheduler.placement.wakes import EVERYTHING, wake_for
from scheduler.settings import Settings, get_settings
from scheduler.store import keys
from scheduler.store.acl import Role
from scheduler.store.cancel import message_text
from scheduler.store.celery_app import make_app
from scheduler.store.connection import REDIS_AWAY, connect, resolve_redis_url
from scheduler.store.shards import announce

log = logging.getLogger("ggufq.placement")
# how often placement looks for jobs whose message to a live device was lost (a job sent
# more than this long ago, unstarted, and in no queue: two looks in a row send it again)
LOST_SWEEP_S = 5.0
MAX_EVENTS = 1000  # events read together before the parked jobs they wake are retried


class Liveness:
    """The placement process's background loops."""

    def __init__(self, service: PlacementService) -> None:
        self.service = service
        self.stopping = threading.Event()
        self.health = LoopHealth()
        self._away = True  # no beat went through yet (or the last one failed)
        self._back_at = -float("inf")  # monotonic time of the first beat after that
        self._next_lost_sweep = 0.0  # monotonic time of the next look for lost messages

    def start(self) -> None:
        settings = self.service.settings
        if settings.metrics_port:
            serve_metrics(
                self.service.r, settings.metrics_port, settings.device_ttl_s, settings.metrics_host
            )
        away = REDIS_AWAY  # else a Redis error (out of memory, read-only) is logged whole
        every = settings.heartbeat_interval_s
        start_loop("placement-alive", self._beat, self.stopping, self.health, every, away)
        start_loop("placement-heart", self._heart, self.stopping, self.health, every, away)
        start_loop("placement-wake", self._listen, self.stopping, self.health, 0.0, away)

    def stop(self) -> None:
        self.stopping.set()
        self.service.state.placement_gone(self.service.name)

    def _heart(self) -> None:
        """Beat, and only beat: the liveness loop's work (parked jobs retried, recovery)
        may take longer than the TTL, and the jobs of a process silent that long are put
        back by the others."""
        every = self.service.settings.heartbeat_interval_s
        self._beat_now(self.health.describe(time.monotonic(), 3 * every, "placement-heart"))

    def _beat_now(self, failing: str) -> float:
        """Beat, and keep the service's clock on Redis's; returns Redis's time."""
        service, before = self.service, time.time()
        beat = service.state.placement_beat(service.name, service.settings.device_ttl_s, failing)
        service.clock.observe(beat, before, time.time())
        return beat

    def _beat(self) -> None:
        """Say this service is alive (and which of its loops keep failing), drop devices
        without a heartbeat, and re-place or fail their jobs; put back the jobs silent
        placement processes had in hand."""
        service, settings = self.service, self.service.settings
        now = time.monotonic()
        failing = self.health.describe(now, 3 * settings.heartbeat_interval_s, "placement-alive")
        try:
            beat = self._beat_now(failing)
        except redis.RedisError:
            self._away = True
            raise
        back, self._away = self._away, False
        try:  # where the jobs' streams live; refused now, said again at the next beat
            announce(service.r, settings.stream_redis_urls)
        except redis.RedisError as exc:
            log.warning("could not say where the jobs' streams live: %s", exc)
        if back:  # the first beat since starting, or since Redis was away
            self._back_at = now
            service.grace_until = now + settings.device_ttl_s
        if service.park_held() or back:
            # events published while Redis was away were lost: retry parked jobs now,
            # not at the next sweep
            service.retry_parked()
        elif now < service.grace_until and service.r.zcard(keys.PARKED):
            # and while the workers come back, at every beat: a job parked because no
            # device beat yet waits for one, and the device_joined event that says so
            # may be published before the waker has subscribed again
            service.retry_parked()
        # after an outage the workers were cut off too: they get a TTL to beat again
        # before any of their devices counts as dead (else an outage would drop them all)
        if now - self._back_at >= settings.device_ttl_s:
            dropped = service.state.reap(settings.device_ttl_s)
            if dropped:
                log.warning("dropped devices without heartbeat: %s", ", ".join(dropped))
            # and other placement processes a TTL: the jobs a silent one held are put back
            if service.recovery.dead_hands(beat, settings.device_ttl_s):
                service.retry_parked()
        service.recover_orphans()
        if now >= self._next_lost_sweep:
            self._next_lost_sweep = now + LOST_SWEEP_S
            service.recovery.lost_sends(beat - LOST_SWEEP_S)
            service.recovery.owed_finals(beat - LOST_SWEEP_S)

    def _listen(self) -> None:
        """Retry parked jobs when an event says capacity may have freed; end parked jobs
        asked to cancel.

        Pub/sub drops messages while disconnected, so a slow sweep
        (GGUFQ_PARK_SWEEP_S) also retries; events, not the sweep, are the normal path.
        """
        sweep_s = self.service.settings.park_sweep_s
        pubsub = self.service.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.EVENTS, keys.CANCELS)
        # events published while this waker was away (Redis restarting, its connection
        # lost) are gone, a device that joined meanwhile with them: retry everything once
        if self.service.r.zcard(keys.PARKED):
            self.service.retry_parked()
        try:
            next_sweep = time.monotonic() + sweep_s
            while not self.stopping.is_set():
                batch = self._received(pubsub)
                self.health.ok("placement-wake")  # the step never returns: it is alive
                wake = wake_for([message_text(m) for m in batch if not self._on_message(m)])
                due = time.monotonic() >= next_sweep
                if due:
                    wake, next_sweep = EVERYTHING, time.monotonic() + sweep_s
                if wake is not None and self.service.r.zcard(keys.PARKED):
                    self.service.retry_parked(wake)
        finally:
            pubsub.close()

    @staticmethod
    def _received(pubsub: Any) -> list[dict[str, Any]]:
        """The messages that came within a second: the first waited for, then all that
        arrived with it (at most MAX_EVENTS), so that a burst of job ends retries parked
        jobs once, not once each."""
        message = pubsub.get_message(timeout=1.0)
        batch: list[dict[str, Any]] = []
        while message is not None and len(batch) < MAX_EVENTS:
            batch.append(message)
            message = pubsub.get_message(timeout=0)
        if message is not None:
            batch.append(message)
        return batch

    def _on_message(self, message: dict[str, Any]) -> bool:
        """Handle a cancel (True: nothing else to do) or a job handed back by a worker."""
        if message_text({"data": message.get("channel", b"")}) == keys.CANCELS:
            self.service.cancel_parked(message_text(message))
            return True
        if "handed_back" in message_text(message):
            self.service.recover_orphans()
        return False


def run_service(settings: Settings) -> None:
    redis_url = resolve_redis_url(settings, Role.PLACEMENT)
    app = make_app(redis_url, settings)
    service = PlacementService(settings, connect(redis_url), app)
    loops = Liveness(service)

    def ready(**_: Any) -> None:
        loops.start()

    def shutdown(**_: Any) -> None:
        loops.stop()

    app.task(name=keys.TASK_PLACE, ignore_result=True)(service.place)
    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutdown.connect(shutdown, weak=False)

    app.worker_main(
        [
            "worker",
            "-Q",
            f"{keys.placement_queue('interactive')},{keys.placement_queue('batch')}",
            "-P",
            "solo",  # placement takes ~2 ms: run it on the consumer thread, no hand-off
            "-c",
            "1",  # jobs for one model keep their order
            "-n",
            f"{service.name}@{settings.host_id}",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "INFO",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="ggufq placement", description="Run a placement service."
    ).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run_service(get_settings())


if __name__ == "__main__":
    main()

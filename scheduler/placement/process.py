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

from scheduler.placement.metrics import serve_metrics
from scheduler.placement.service import PlacementService
from scheduler.settings import Settings, get_settings
from scheduler.store import keys
from scheduler.store.celery_app import make_app
from scheduler.store.connection import resolve_redis_url

log = logging.getLogger("ggufq.placement")


class Liveness:
    """The placement process's background loops."""

    def __init__(self, service: PlacementService) -> None:
        self.service = service
        self.stopping = threading.Event()

    def start(self) -> None:
        if self.service.settings.metrics_port:
            serve_metrics(
                self.service.r,
                self.service.settings.metrics_port,
                self.service.settings.device_ttl_s,
            )
        threading.Thread(target=self._alive_loop, name="ggufq-placement-alive", daemon=True).start()
        threading.Thread(target=self._wake_loop, name="ggufq-placement-wake", daemon=True).start()

    def _wake_loop(self) -> None:
        """Retry parked jobs when an event says capacity may have freed.

        Pub/sub drops messages while disconnected, so a slow sweep
        (GGUFQ_PARK_SWEEP_S) also retries; events, not the sweep, are the normal path.
        """
        pubsub = self.service.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.EVENTS, keys.CANCELS)
        next_sweep = time.monotonic() + self.service.settings.park_sweep_s
        while not self.stopping.is_set():
            try:
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message["channel"].decode() == keys.CANCELS:
                    self.service.cancel_parked(message["data"].decode())
                    continue
                if message is not None and b"handed_back" in message["data"]:
                    self.service.recover_orphans()
                due = time.monotonic() >= next_sweep
                if (message is not None or due) and self.service.r.zcard(keys.PARKED):
                    self.service.retry_parked()
                if due:
                    next_sweep = time.monotonic() + self.service.settings.park_sweep_s
            except redis.RedisError as exc:
                log.warning("parked-job waker: %s", exc)
                self.stopping.wait(1.0)

    def stop(self) -> None:
        self.stopping.set()
        self.service.state.placement_gone(self.service.name)

    def _alive_loop(self) -> None:
        while True:
            try:
                self.service.state.placement_beat(
                    self.service.name, time.time(), self.service.settings.device_ttl_s
                )
                dropped = self.service.state.reap(time.time(), self.service.settings.device_ttl_s)
                if dropped:
                    log.warning("dropped devices without heartbeat: %s", ", ".join(dropped))
                self.service.recover_orphans()
            except redis.RedisError as exc:
                log.warning("placement heartbeat failed: %s", exc)
            if self.stopping.wait(self.service.settings.heartbeat_interval_s):
                return


def run_service(settings: Settings) -> None:
    redis_url = resolve_redis_url(settings)
    app = make_app(redis_url, settings)
    service = PlacementService(settings, redis.Redis.from_url(redis_url), app)
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

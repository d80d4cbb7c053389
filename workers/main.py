"""Entry point of a worker process: `ggufq worker` or `python -m workers.main`."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import replace
from typing import Any

from celery import signals
from celery.exceptions import Ignore
from celery.worker.control import control_command

from scheduler.errors import GgufqError, JobCancelled
from scheduler.gguf.registry import Registry
from scheduler.settings import Settings, get_settings
from scheduler.store import keys
from scheduler.store.acl import Role
from scheduler.store.celery_app import make_app
from scheduler.store.connection import connect, resolve_redis_url
from scheduler.units import parse_bytes
from workers.args import add_worker_arguments
from workers.devices import detect_devices
from workers.handback import NotOwned
from workers.progress import ProgressEvents
from workers.runtime import WorkerRuntime

log = logging.getLogger("ggufq.worker")


def run_worker(settings: Settings, virtual_sizes: list[int], use_gpus: bool = True) -> None:
    # CUDA numbers GPUs fastest first by default, NVML by PCI bus: make them agree, so that
    # gpu:<host>:<n> is CUDA device n for llama.cpp (before CUDA starts in this process)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    redis_url = resolve_redis_url(settings, Role.WORKER)
    app = make_app(redis_url, settings, stash_unacked=False)  # see make_app
    host = settings.host_id
    devices = detect_devices(host, "", virtual_sizes, use_gpus)
    label = "+".join(d.id.split(":", 1)[0] + d.id.rsplit(":", 1)[-1] for d in devices)
    worker_name = f"ggufq-{label}@{host}" if devices[0].kind != "cpu" else f"ggufq-cpu@{host}"
    devices = [replace(d, worker=worker_name) for d in devices]
    client = connect(redis_url)
    runtime = WorkerRuntime(settings, client, devices, Registry(settings.models_dir))
    events = ProgressEvents(app, worker_name) if settings.task_events else None

    def run(self: Any, job: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
        # the text relay reports from its own thread, where self.request is empty
        task_id = self.request.id

        def progress(state: str, **fields: Any) -> None:
            if events is not None:
                events.send(task_id, state, **fields)

        try:
            return runtime.run_job(job, placement, progress)
        except NotOwned as exc:
            log.info(
                "dropping job %s: placement placed it again or ended it (its outcome is "
                "not this run's to store)",
                exc,
            )
            raise Ignore() from None
        except JobCancelled as exc:
            # the job's state is REVOKED (cancelled), not FAILURE
            self.backend.mark_as_revoked(self.request.id, reason=str(exc))
            # Ignore sends no event, and Celery's event state ranks REVOKED below custom
            # states such as GENERATING: a custom CANCELLED is what Flower can show
            progress("cancelled", reason=str(exc))
            raise Ignore() from None

    app.task(name=keys.TASK_RUN, bind=True, throws=(GgufqError,))(run)

    @control_command(  # type: ignore[untyped-decorator]
        args=[("runner_id", str), ("when_idle", bool)], signature="<runner_id> [when_idle]"
    )
    def ggufq_unload(_state: Any, runner_id: str, when_idle: bool = False) -> dict[str, str]:
        # runs in the consumer, beside the pool: unloading never waits behind jobs, and
        # happens in a thread of its own so that the consumer is not held up
        threading.Thread(
            target=runtime.request_unload, args=(runner_id, when_idle), daemon=True
        ).start()
        return {"ok": f"unloading {runner_id}"}

    def ready(**_: Any) -> None:
        runtime.start()

    def shutdown(**_: Any) -> None:
        runtime.stop()
        if events is not None:
            events.close()

    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutdown.connect(shutdown, weak=False)

    queues = ",".join(keys.device_queue(d.id, p) for p in ("interactive", "batch") for d in devices)
    app.worker_main(
        [
            "worker",
            "-Q",
            queues,
            "-P",
            "threads",
            "-c",
            str(pool_size(settings, len(devices))),
            "-n",
            worker_name,
            "--without-mingle",
            "--without-gossip",
            "-l",
            "INFO",
        ]
    )


def pool_size(settings: Settings, n_devices: int) -> int:
    """Celery threads: a job holds one while it runs or waits for a slot, so a worker needs
    at least as many as the slots of the runners it may hold, or slots would sit idle, plus
    the jobs placement lets wait at each runner (``runner_queue``, default its slots): the
    runner admits those in fair order, not the device queue's first come first served."""
    widest = max([settings.num_parallel, *settings.model_parallel.values()])
    queue = settings.runner_queue
    per_runner = widest + (widest if queue is None or queue < 0 else queue)
    return max(settings.worker_threads, per_runner * settings.max_loaded_models * n_devices)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ggufq worker", description=__doc__)
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    start_from_args(args)


def start_from_args(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sizes = [parse_bytes(s) for s in args.virtual_gpu]
    run_worker(get_settings(), sizes, use_gpus=not args.cpu)


if __name__ == "__main__":
    main()

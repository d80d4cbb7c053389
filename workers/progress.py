"""Task events for Flower's live job states, sent from a thread of their own.

The text relay (workers/engine/relay.py) reports GENERATING from its thread; opening an
event dispatcher there (a Redis connection and a publish) held up every sequence of the
runner, about 12 % of the throughput of 8 busy slots on 2 cores. Reports go on a queue
instead; one thread with one dispatcher sends them, and drops the oldest when it falls
behind (a state is only news).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)


class ProgressEvents:
    def __init__(self, app: Celery, hostname: str, maxsize: int = 1000) -> None:
        self.app, self.hostname = app, hostname
        self._queue: queue.Queue[tuple[str, str, dict[str, Any]] | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name="ggufq-events", daemon=True)
        self._thread.start()

    def send(self, task_id: str, state: str, **fields: Any) -> None:
        """Queue ``task-<state>`` for ``task_id`` (Flower shows it as the task's STATE)."""
        item = (task_id, state, fields)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            try:
                self._queue.get_nowait()  # the oldest news goes first
            except queue.Empty:
                pass
            self._queue.put_nowait(item)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            try:
                with self.app.events.default_dispatcher(hostname=self.hostname) as dispatcher:
                    while (item := self._queue.get()) is not None:
                        task_id, state, fields = item
                        dispatcher.send(f"task-{state}", uuid=task_id, **fields)
                    return
            except Exception as exc:  # Redis away: keep the worker, lose a state report
                log.warning("task event not sent: %s", exc)
                time.sleep(1.0)  # and do not spin while it is away

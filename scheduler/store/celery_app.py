"""The Celery application every ggufq process shares: JSON only, Redis broker and results."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from celery import Celery

from scheduler.protocol import JobRequest, Placement
from scheduler.settings import Settings
from scheduler.store import keys, sentinel
from scheduler.store.transport import SentinelTransport, Transport


def make_app(redis_url: str, settings: Settings, *, stash_unacked: bool = True) -> Celery:
    """``stash_unacked=False`` (workers): a message taken off a queue is not recorded in
    Redis as unacknowledged. kombu's record costs a round trip as each message arrives and
    another as it is acknowledged, both on a job's way to its first token, and a device
    queue's messages do not need it: placement's in-flight record of every job it sent
    already brings one back that no worker started (``Recovery.lost_sends`` sends it
    again, ``Recovery.orphans`` re-places the jobs of a dropped device), and the start
    claim runs it once however often it is delivered. The placement queue keeps the
    record: it is all that brings back a submission whose placement process died."""
    url, transport, options, tls = redis_url, Transport, {}, None
    if sentinel.is_sentinel(redis_url):  # kombu's form, and its transport for it
        found = sentinel.parse(redis_url)
        options = found.transport_options(sentinel.sentinel_kwargs(found))
        url, transport = found.kombu_url, SentinelTransport
        tls = found.tls_options or None  # kombu's form has no TLS of its own: told apart
    app = Celery("ggufq", broker=url, backend=url, set_as_current=False)
    if tls is not None:
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=settings.result_ttl_s,
        # a result holds the job's outcome only: with result_extended it held the whole
        # request too (every prompt kept for result_ttl_s), and nothing reads it
        result_extended=False,
        task_default_queue=keys.PLACEMENT_QUEUE,
        # Jobs are long and each worker owns its device: take one message at a time, so a
        # job is never stuck behind another in a busy worker's prefetch buffer.
        worker_prefetch_multiplier=1,
        # and no more than the pool can start at once: a message waiting in a worker's
        # buffer is not yet acknowledged, and the broker would hand it to another worker
        # after the visibility timeout, so that the job ran twice
        worker_disable_prefetch=True,
        task_acks_late=False,
        task_track_started=False,
        # events feed Flower: tasks appear when sent and show their states live
        # (workers add LOADING and GENERATING); a few hundred bytes of pub/sub per state
        task_send_sent_event=settings.task_events,
        worker_send_task_events=settings.task_events,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport=transport,  # kombu's Redis transport, robust to bad queue items
        worker_consumer="scheduler.store.transport:Consumer",  # reconnects within 0.25 s
        # a result stored as Redis goes away waits for it (tried again up to 1 s apart)
        # instead of failing the task after the job ran
        result_backend_always_retry=True,
        result_backend_max_retries=120,  # about two minutes
        result_backend_max_sleep_between_retries_ms=1000,
        broker_transport_options={
            "socket_keepalive": True,
            "visibility_timeout": settings.broker_visibility_timeout_s,
            "unacked_restore_interval": settings.broker_restore_interval_s,
            "unacked_restore_throttle": 1,
            "ack_emulation": stash_unacked,
            **options,
        },
        result_backend_transport_options=options,
        enable_utc=True,
    )
    return app


def close_app(app: Celery) -> None:
    """Close an app made by :func:`make_app`: the result backend's connections too, which
    ``app.close()`` leaves to the garbage collector (a ResourceWarning, sometimes)."""
    app.backend.client.close()
    app.close()


def ask_unload(app: Celery, worker: str, runner_id: str, when_idle: bool = False) -> None:
    """Ask a worker to unload a runner. A remote-control command, not a task: it runs in the
    worker's consumer at once, never queued behind the jobs of its device."""
    app.control.broadcast(
        keys.CONTROL_UNLOAD,
        arguments={"runner_id": runner_id, "when_idle": when_idle},
        destination=[worker],
        reply=False,
    )


def send_job(
    app: Celery, task: str, req: JobRequest, task_id: str, queue: str, *extra: Any
) -> None:
    """Send a job's task with a short readable repr (Flower shows it; Celery's own repr of a
    large prompt costs milliseconds per send), and no result to wait for: Celery's result
    consumer would otherwise subscribe the sender to the task's result channel, a
    subscription nobody reads, whose channel name and unread replies it then keeps for the
    process's life (a gateway or client leaked them for every job it sent to placement)."""
    app.send_task(
        task,
        args=[req.model_dump(mode="json"), *extra],
        task_id=task_id,
        queue=queue,
        argsrepr=_argsrepr(req),
        kwargsrepr="{}",
        ignore_result=True,
    )


def task_message(
    app: Celery, task: str, req: JobRequest, task_id: str, queue: str, *extra: Any
) -> str:
    """The queue item :func:`send_job` would push onto ``queue``'s Redis list (Celery's
    message, in kombu's Redis envelope), for a script that pushes it itself in the same
    atomic step as its other writes: a job's send (lua/sent.lua), its send again as a new
    placement (lua/resend.lua) and the fast path's (lua/fast_send.lua)."""
    message = app.amqp.as_task_v2(
        task_id,
        task,
        args=[req.model_dump(mode="json"), *extra],
        kwargs={},
        argsrepr=_argsrepr(req),
        kwargsrepr="{}",
    )
    body = json.dumps(list(message.body)).encode()
    properties = dict(
        message.properties,
        delivery_mode=2,
        priority=0,
        body_encoding="base64",
        delivery_tag=str(uuid.uuid4()),
        delivery_info={"exchange": "", "routing_key": queue},
    )
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": message.headers,
            "properties": properties,
        }
    )


def run_message(app: Celery, req: JobRequest, placement: Placement) -> tuple[str, str]:
    """The device queue a job's run goes on as ``placement`` names it, and its message
    there (:func:`task_message`)."""
    queue = keys.device_queue(placement.device_id, req.priority)
    sent = placement.model_dump(mode="json")
    return queue, task_message(app, keys.TASK_RUN, req, req.id, queue, sent)


def _argsrepr(req: JobRequest) -> str:
    prompt = req.prompt if len(req.prompt) <= 40 else req.prompt[:39] + "…"
    return f"(model={req.model!r}, job={req.id}, prompt={prompt!r})"

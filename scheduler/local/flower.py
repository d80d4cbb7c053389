"""Flower, Celery's dashboard, on ggufq's Celery app.

``ggufq flower`` runs it; so does the plain form ``celery -A scheduler.local.flower flower``
(this module's ``app`` is built from the GGUFQ_* settings on first use). Workers are named
for their host and devices (``ggufq-gpu0+gpu1@host``), each device has its queues, and each
job is a ``ggufq.run`` task named by model, job id and a shortened prompt, with the custom
states LOADING and GENERATING (with a token count) while it runs, and CANCELLED.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Celery

from scheduler.settings import Settings, get_settings
from scheduler.store.acl import Role
from scheduler.store.celery_app import make_app
from scheduler.store.connection import resolve_redis_url


def flower_app(settings: Settings) -> Celery:
    """The app Flower runs on: kombu's plain Redis transport, whose URL scheme Flower's
    broker page knows (Flower only reads the queues, never consumes them)."""
    # no unacked bookkeeping: Flower takes no job, and must not put others' messages back
    app = make_app(resolve_redis_url(settings, Role.MONITOR), settings, stash_unacked=False)
    app.conf.broker_transport = None
    return app


@cache
def _default_app() -> Celery:
    return flower_app(get_settings())


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):  # what `celery -A scheduler.local.flower` looks up
        return _default_app()
    raise AttributeError(name)


def run_flower(settings: Settings, port: int, address: str, extra: list[str]) -> None:
    app = flower_app(settings)
    app.start(["flower", f"--port={port}", f"--address={address}", *extra])

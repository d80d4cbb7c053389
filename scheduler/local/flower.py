"""Flower, Celery's dashboard, on ggufq's Celery app.

``ggufq flower`` runs it; so does the plain form ``celery -A scheduler.local.flower flower``
(this module's ``app`` is built from the GGUFQ_* settings on first use). Workers are named
for their host and devices (``ggufq-gpu0+gpu1@host``), each device has its queues, and each
job is a ``ggufq.run`` task named by model, job id and a shortened prompt, with the custom
states LOADING and GENERATING (with a token count) while it runs, and CANCELLED. Its
navigation bar links to the gateway's pool page (devices, runners, queues: ``/ui``).
"""

from __future__ import annotations

import html
import logging
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from celery import Celery

from scheduler.settings import Settings, get_settings
from scheduler.store.acl import Role
from scheduler.store.celery_app import make_app
from scheduler.store.connection import resolve_redis_url

log = logging.getLogger(__name__)
# where Flower's navigation bar lists its pages (flower/templates/navbar.html, Flower 2.x)
_NAV = '<ul class="app-nav navbar-nav">'


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


def with_pool_link(templates: Path, pool_url: str, into: Path) -> bool:
    """Copy Flower's ``templates`` into ``into`` with a "Pool" page in its navigation bar
    linking to ``pool_url``; False (nothing written) when the bar is not one this knows."""
    navbar = (templates / "navbar.html").read_text()
    start = navbar.find(_NAV)
    end = navbar.find("</ul>", start)
    if start < 0 or end < 0:
        return False
    href = html.escape(pool_url.replace("{", "%7B").replace("}", "%7D"))  # no template code
    link = (
        f'  <li class="nav-item"><a class="nav-link" id="ggufq-pool" href="{href}" '
        'title="ggufq: devices, runners and queues">Pool</a></li>\n      '
    )
    shutil.copytree(templates, into, dirs_exist_ok=True)
    (into / "navbar.html").write_text(navbar[:end] + link + navbar[end:])
    return True


def run_flower(
    settings: Settings, port: int, address: str, extra: list[str], pool_url: str
) -> None:
    from flower.urls import settings as flower_settings  # the dict Flower builds its app of

    app = flower_app(settings)
    templates = Path(tempfile.mkdtemp(prefix="ggufq-flower-"))
    try:
        try:
            linked = with_pool_link(Path(flower_settings["template_path"]), pool_url, templates)
        except (OSError, KeyError, TypeError) as exc:  # another Flower's templates
            log.warning("cannot add the pool page's link to Flower's pages (%r)", exc)
            linked = False
        if linked:
            flower_settings["template_path"] = str(templates)
        else:
            log.warning("this Flower's pages are not the ones ggufq knows: no link to %s", pool_url)
        app.start(["flower", f"--port={port}", f"--address={address}", *extra])
    finally:
        shutil.rmtree(templates, ignore_errors=True)

"""Where each job's token stream lives: GGUFQ_REDIS_URL's Redis by default, or one of the
Redis instances of GGUFQ_STREAM_REDIS_URLS, chosen by a stable hash of the job's id, so
that stream traffic (a chunk's XADD, PUBLISH and EXPIRE, its readers' subscriptions and
backfills) grows with the instances while the control state stays on one primary.

A stream's instance keeps a record of its own beside the stream
(``ggufq:job:<id>:custody``, with only a ``holder`` and an ``epoch``): the run that claims
the stream (lua/stream_claim.lua, right after its start, under its custody epoch),
placement as it takes the job from a run (lua/stream_fence.lua: no holder) and the final
chunk name it, so a run the job was taken from is refused its chunks there as the custody
record refuses them where the two live together. A job's end owes its final chunk there
until it is written (ggufq:due:final). Docs: README, "Several hosts".
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import redis

from scheduler.errors import BadSettings
from scheduler.redis_urls import address, split_urls

C = TypeVar("C")
D = TypeVar("D")

WHERE = "ggufq:stream_shards"  # the instances placement serves streams on, as it said last
log = logging.getLogger(__name__)


def shard_of(job_id: str, count: int) -> int:
    """The index of the instance that holds ``job_id``'s stream among ``count``: the same
    in every process and every run (CRC-32 of the id)."""
    return zlib.crc32(job_id.encode()) % count


class Shards(Generic[C]):
    """One thing per stream instance (a client, a pool of subscriptions): ``control``'s
    alone when the streams live beside the control state."""

    __slots__ = ("control", "others")

    def __init__(self, control: C, others: Sequence[C] = ()) -> None:
        self.control = control
        self.others = list(others)

    @property
    def sharded(self) -> bool:
        """Whether the streams live apart from the control state."""
        return bool(self.others)

    def of(self, job_id: str) -> C:
        """What serves ``job_id``'s stream."""
        if not self.others:
            return self.control
        return self.others[shard_of(job_id, len(self.others))]

    @property
    def all(self) -> list[C]:
        """Every stream instance's (the control's alone when not sharded)."""
        return self.others or [self.control]

    def map(self, make: Callable[[C], D]) -> Shards[D]:
        """The same instances, each through ``make`` (a pool of subscriptions per client)."""
        return Shards(make(self.control), [make(other) for other in self.others])


def stream_shards(
    control: redis.Redis,
    urls: str,
    connect: Callable[[str], redis.Redis],
    placement: bool = False,
) -> Shards[redis.Redis]:
    """The stream instances of GGUFQ_STREAM_REDIS_URLS (``urls``) connected with
    ``connect``, after :func:`agree`. ``control`` is the control state's client."""
    found = split_urls(urls)
    agree(control, found, placement)
    return Shards(control, [connect(url) for url in found])


def _where(urls: list[str]) -> str:
    """The instances as every process names them alike, without credentials."""
    return json.dumps([address(url) for url in urls])


WHERE_TTL_S = 120  # placement says it again with every beat: a list no placement serves lapses


def agree(control: redis.Redis, urls: list[str], placement: bool) -> None:
    """Placement says where the streams live (``ggufq:stream_shards``, again with every
    beat: :func:`announce`); every other process checks that it was given the same
    instances, in the same order, and refuses to start otherwise (its readers would wait on
    one instance while the worker writes to another). Redis away: nothing to check
    against yet; Redis's own error is raised at first use."""
    where = _where(urls)
    try:
        if placement:
            announce(control, urls)
            return
        raw = control.get(WHERE)
    except redis.RedisError:
        return
    said = raw.decode() if isinstance(raw, bytes) else raw
    if said is not None and said != where:
        raise BadSettings(
            f"GGUFQ_STREAM_REDIS_URLS names the stream instances {where}, and placement "
            f"serves this cluster's streams on {said}: give every process the same list, "
            "in the same order"
        )


def announce(control: redis.Redis, urls: str | list[str]) -> None:
    """Placement says where the streams live, for a while (:data:`WHERE_TTL_S`); it logs
    an error when another placement process said otherwise."""
    where = _where(split_urls(urls) if isinstance(urls, str) else urls)
    before = control.set(WHERE, where, ex=WHERE_TTL_S, get=True)
    said = before.decode() if isinstance(before, bytes) else before
    if said is not None and said != where:
        log.error(
            "placement processes serve streams on different instances (%s here, %s there): "
            "give every process the same GGUFQ_STREAM_REDIS_URLS",
            where,
            said,
        )

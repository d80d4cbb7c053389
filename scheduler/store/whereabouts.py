"""Whether a job is where its custody record says (lua/whereabouts.lua), for a reader that
waits: every script that moves a job writes its record and the place it goes (a hold in
``ggufq:in_hand``, ``ggufq:parked``, ``ggufq:orphans``) in one step, so a job recorded
there and not held there, whose stream has not ended, is lost: only a bug or data edited
by hand leaves one so, and nobody would ever move it on. Its reader, finding it so at two
looks at least :data:`LOOK_EVERY_S` apart with its record unmoved, gets ``JobLost``
instead of waiting out its timeout. The record is left as it is, for ``ggufq fsck``.

Jobs recorded sent or running are not looked at here: their place is a device's records,
which the reap and the worker's own looks hold them to.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple

import redis
import redis.asyncio

from scheduler.errors import JobLost
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY
from scheduler.store.records import text
from scheduler.store.scripts import script

log = logging.getLogger(__name__)

LOOK_EVERY_S = 15.0  # a reader looks at most this often, the first this long after its first check
_PLACES = {"placing": f"{keys.IN_HAND} (as its holder's)", "parked": keys.PARKED}


class Found(NamedTuple):
    """One look: the job's recorded state and epoch, and whether the place that state
    names holds it (1), does not (0), or was not looked at (-1)."""

    state: str
    epoch: str
    held: int

    @classmethod
    def of(cls, reply: tuple[bytes, bytes, int]) -> Found:
        state, epoch, held = reply
        return cls(text(state), text(epoch), int(held))


class Whereabouts:
    """One reader's looks at its job (``turn``, then ``seen`` with what a look found)."""

    __slots__ = ("job_id", "next_at", "last")  # one a waiting reader: no dict each

    def __init__(self, job_id: str, now: float) -> None:
        self.job_id = job_id
        self.next_at = now + LOOK_EVERY_S
        self.last: Found | None = None  # the last look's, when it found the job nowhere

    def turn(self, now: float) -> bool:
        """Whether a look is due now; if so, the next is due :data:`LOOK_EVERY_S` on."""
        if now < self.next_at:
            return False
        self.next_at = now + LOOK_EVERY_S
        return True

    def seen(self, found: Found) -> bool:
        """Take one look's answer: True when this look and the last found the job nowhere,
        its record unmoved between them."""
        if found.held != 0:
            self.last = None
            return False
        lost, self.last = found == self.last, found
        return lost

    def lost(self) -> JobLost:
        found = self.last
        assert found is not None
        return JobLost(
            f"job {self.job_id} is lost: its custody record says {found.state} (epoch "
            f"{found.epoch}), but {_PLACES.get(found.state, keys.ORPHANS)} does not hold it, "
            f"at two looks at least {LOOK_EVERY_S:g} s apart, and nothing will move it on (a "
            "bug, or Redis's data edited by hand: run `ggufq fsck`); submit it again as a "
            "new job (this id stays taken while its record is kept)"
        )


def look_if_due(
    client: redis.Redis, stream: redis.Redis, job_id: str, where: Whereabouts | None
) -> Whereabouts:
    """A reader's look at its job's whereabouts when one is due; raises JobLost when it
    is lost (``stream``: the Redis its stream lives on, whose final chunk says it ended)."""
    where, due = _due(job_id, where)
    if due:
        try:
            found = Found.of(script(client, "whereabouts")(*_args(job_id)))
            if where.seen(found) and not _ended(stream.xrevrange(keys.job_chunks(job_id), count=1)):
                raise where.lost()
        except redis.RedisError as exc:
            _unanswered(job_id, exc)
    return where


async def alook_if_due(
    client: redis.asyncio.Redis, stream: redis.asyncio.Redis, job_id: str, where: Whereabouts | None
) -> Whereabouts:
    """:func:`look_if_due` on redis.asyncio."""
    where, due = _due(job_id, where)
    if due:
        try:
            found = Found.of(await script(client, "whereabouts")(*_args(job_id)))
            if where.seen(found) and not _ended(
                await stream.xrevrange(keys.job_chunks(job_id), count=1)
            ):
                raise where.lost()
        except redis.RedisError as exc:
            _unanswered(job_id, exc)
    return where


def _due(job_id: str, where: Whereabouts | None) -> tuple[Whereabouts, bool]:
    now = time.monotonic()
    return (Whereabouts(job_id, now), False) if where is None else (where, where.turn(now))


def _args(job_id: str) -> tuple[list[str], list[str]]:
    return [keys.job_custody(job_id), keys.IN_HAND, keys.PARKED, keys.ORPHANS], [job_id]


def _ended(last: Any) -> bool:
    """Whether the stream's last entry ``last`` (XREVRANGE COUNT 1) is a final chunk: the
    job ended, and its readers take its end from there."""
    try:
        return bool(json.loads(last[0][1][b"c"]).get("done"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


_said: list[str] = []  # the first look Redis refused in this process (said once)


def _unanswered(job_id: str, exc: redis.RedisError) -> None:
    """Redis away: the next look tells. Refused (an ACL without the script's keys, say):
    said once a process, and looked at again at the next turn."""
    if not isinstance(exc, REDIS_AWAY) and not _said:
        _said.append(str(exc))
        log.warning("job %s: looking where it is failed (said once): %s", job_id, exc)

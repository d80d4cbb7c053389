"""Whether a job is where its custody record says (lua/whereabouts.lua), for a reader that
waits: every script that moves a job writes its record and the place it goes (a hold in
``ggufq:in_hand``, ``ggufq:parked``, ``ggufq:orphans``) in one step, so a job recorded
there and not held there is lost; only a bug or data edited by hand leaves one so, and
nobody would ever move it on (``ggufq fsck`` reports it "found nowhere"). Its reader,
finding it so at two looks :data:`LOOK_EVERY_S` apart with its record unmoved, gets
``JobLost`` instead of waiting out its timeout. The record is left as it is, for fsck.

Jobs recorded sent or running are not looked at here: their place is a device's records,
which the reap and the worker's own looks hold them to.
"""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import redis
import redis.asyncio

from scheduler.errors import JobLost
from scheduler.store import keys
from scheduler.store.records import text
from scheduler.store.scripts import script

LOOK_EVERY_S = 15.0  # a waiting reader looks this often, the first time this long after it began
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
    """One reader's looks at its job (``due``, then ``seen`` with what the look found)."""

    __slots__ = ("job_id", "next_at", "last")  # one a waiting reader: no dict each

    def __init__(self, job_id: str, now: float) -> None:
        self.job_id = job_id
        self.next_at = now + LOOK_EVERY_S
        self.last: Found | None = None  # the last look's, when it found the job nowhere

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def seen(self, found: Found, now: float) -> None:
        """Take one look's answer; raise JobLost when this look and the last found the job
        nowhere, its record unmoved between them."""
        self.next_at = now + LOOK_EVERY_S
        if found.held != 0:
            self.last = None
            return
        if found != self.last:
            self.last = found
            return
        raise JobLost(
            f"job {self.job_id} is lost: its custody record says {found.state} (epoch "
            f"{found.epoch}), but {_PLACES.get(found.state, keys.ORPHANS)} does not hold it, "
            f"at two looks {LOOK_EVERY_S:g} s apart, and nothing will move it on (a bug, or "
            "Redis's data edited by hand; `ggufq fsck` names it); submit the job again"
        )


def look_if_due(client: redis.Redis, job_id: str, where: Whereabouts | None) -> Whereabouts:
    """A reader's look at its job's whereabouts when one is due (the first
    :data:`LOOK_EVERY_S` after it began); raises JobLost when it is lost."""
    where, due = _due(job_id, where)
    if due:
        with contextlib.suppress(redis.RedisError):  # Redis away: the next look tells
            where.seen(Found.of(script(client, "whereabouts")(*_args(job_id))), time.monotonic())
    return where


async def alook_if_due(
    client: redis.asyncio.Redis, job_id: str, where: Whereabouts | None
) -> Whereabouts:
    """:func:`look_if_due` on redis.asyncio."""
    where, due = _due(job_id, where)
    if due:
        with contextlib.suppress(redis.RedisError):  # Redis away: the next look tells
            found = await script(client, "whereabouts")(*_args(job_id))
            where.seen(Found.of(found), time.monotonic())
    return where


def _due(job_id: str, where: Whereabouts | None) -> tuple[Whereabouts, bool]:
    now = time.monotonic()
    return (Whereabouts(job_id, now), False) if where is None else (where, where.due(now))


def _args(job_id: str) -> tuple[list[str], list[str]]:
    return [keys.job_custody(job_id), keys.IN_HAND, keys.PARKED, keys.ORPHANS], [job_id]

"""Whether a job is where its custody record says (lua/whereabouts.lua), for a reader that
waits: every script that moves a job writes its record and the place it goes (a hold in
``ggufq:in_hand``, ``ggufq:parked``, ``ggufq:orphans``, its device's in-flight records) in
one step, so a job recorded there and not held there, whose stream neither ended nor
moved on, is lost: only a bug or data edited by hand leaves one so, and nobody would
ever move it on. Its reader, finding it so at two looks at least :data:`LOOK_EVERY_S`
apart with its record and its stream unmoved, gets ``JobLost`` instead of waiting out its
timeout. The record is left as it is, for ``ggufq fsck``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
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


class Found(NamedTuple):
    """One look: the job's recorded state, epoch and device, whether the place that state
    names holds it (1), does not (0), or was not looked at (-1), and, when not, its
    stream's last entry."""

    state: str
    epoch: str
    held: int
    device: str = ""
    stream_at: str = ""

    @classmethod
    def of(cls, reply: tuple[bytes, bytes, int, bytes]) -> Found:
        state, epoch, held, device = reply
        return cls(text(state), text(epoch), int(held), text(device))

    def in_stream(self, last: Any) -> Found:
        """This look with its stream's last entry ``last`` (XREVRANGE COUNT 1): a final
        chunk there ends the question (the job ended; its readers take its end from
        there), another is where the stream has got to."""
        try:
            entry_id, fields = last[0]
        except (ValueError, TypeError, IndexError):
            return self  # an empty stream
        at = self._replace(stream_at=text(entry_id))
        try:
            ended = json.loads(fields.get(b"c", fields.get("c"))).get("done")
        except (ValueError, TypeError, AttributeError):
            return at
        return self._replace(held=-1) if ended else at

    @property
    def place(self) -> str:
        if self.state == "placing":
            return f"{keys.IN_HAND} (as its holder's)"
        if self.state in ("sent", "running"):
            return keys.inflight(self.device)
        return keys.PARKED if self.state == "parked" else keys.ORPHANS


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
        its record and its stream unmoved between them."""
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
            f"{found.epoch}), but {found.place} does not hold it, "
            f"at two looks at least {LOOK_EVERY_S:g} s apart, and nothing will move it on (a "
            "bug, or Redis's data edited by hand: run `ggufq fsck`); submit it again as a "
            "new job (this id stays taken while its record is kept)"
        )


def look_if_due(
    client: redis.Redis,
    stream_of: Callable[[], redis.Redis],
    job_id: str,
    where: Whereabouts | None,
) -> Whereabouts:
    """A reader's look at its job's whereabouts when one is due; raises JobLost when it
    is lost (``stream_of``: the Redis its stream lives on, whose last entry says whether
    it ended or moved on; asked for only when the look finds the job nowhere)."""
    where, due = _due(job_id, where)
    if due:
        try:
            found = Found.of(script(client, "whereabouts")(*_args(job_id)))
            if found.held == 0:
                last = stream_of().xrevrange(keys.job_chunks(job_id), count=1)
                found = found.in_stream(last)
            if where.seen(found):
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
            if found.held == 0:
                last = await stream.xrevrange(keys.job_chunks(job_id), count=1)
                found = found.in_stream(last)
            if where.seen(found):
                raise where.lost()
        except redis.RedisError as exc:
            _unanswered(job_id, exc)
    return where


def _due(job_id: str, where: Whereabouts | None) -> tuple[Whereabouts, bool]:
    now = time.monotonic()
    return (Whereabouts(job_id, now), False) if where is None else (where, where.turn(now))


def _args(job_id: str) -> tuple[list[str], list[str]]:
    return [keys.job_custody(job_id), keys.IN_HAND, keys.PARKED, keys.ORPHANS], [job_id]


_said: list[str] = []  # the first look Redis refused in this process (said once)


def _unanswered(job_id: str, exc: redis.RedisError) -> None:
    """Redis away: the next look tells. Refused (an ACL without the script's keys, say):
    said once a process, and looked at again at the next turn."""
    if not isinstance(exc, REDIS_AWAY) and not _said:
        _said.append(str(exc))
        log.warning("job %s: looking where it is failed (said once): %s", job_id, exc)

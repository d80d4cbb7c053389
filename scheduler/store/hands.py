"""The jobs a placement process has in hand: a submission it claimed, a parked job or an
orphan it took, until it sends, parks or ends it.

Each is held in Redis (``ggufq:in_hand``) under a token, with the record it came with, so
that a placement process that dies (or stalls past the TTL) mid-step loses nothing: any
other one puts the job back where it came from (:meth:`Hands.sweep`), once, and marks that
hold swept in the job's custody record (which keeps its last hold's token), so that a
holder that was only stalled does nothing more with it (its send and put-back scripts
look, and it ends no job swept from it). The token of a job is kept for
the thread that handles it: a placement process handles jobs on more than one thread, each
from start to end on one (:meth:`Hands.hand_over` and :meth:`Hands.adopt` move one).
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from enum import IntEnum
from functools import partial
from typing import Any, Literal, cast

import redis

from scheduler.protocol import SentJob
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY, again_if_lost
from scheduler.store.scripts import execute, queue, script
from scheduler.store.shards import Shards
from scheduler.store.streams import pay, write_final

Taken = Literal["orphan", "parked"]


class Swept(IntEnum):
    """What lua/sweep.lua did with a job a silent placement process held (its header
    cites these values)."""

    NOTHING = 0  # gone, held under another token, or its holder beats again
    PUT_BACK = 1  # back where it was taken from
    LET_GO = 2  # let go only: it was sent (its device's records hold it) or it ended
    ENDING = 3  # let go of a job its holder was ending, and ended with the chunk given
    UNREADABLE = -1  # let go of an entry that does not parse, and its job ended so


class PutBack(IntEnum):
    """What lua/put_back.lua did with a job its holder parks or returns (its header cites
    these values)."""

    SWEPT = 0  # another placement process put it back already: it is that one's now
    PUT_BACK = 1
    SENT = 2  # its send step ran (what failed came after): let go of only, its device's
    # records account for it


class TakeUnsure(redis.ConnectionError):
    """Redis did not answer a take: the record may be taken under ``token``, and only the
    taker asking again with it once Redis answers gets it back (``HeldJobs.hold_take``)."""

    def __init__(self, what: Taken, job_id: str, token: str, cause: Exception) -> None:
        super().__init__(f"taking {what} job {job_id}: {cause}")
        self.what, self.job_id, self.token = what, job_id, token


def parked_record(job: dict[str, Any], score: float, errors: int = 0) -> str:
    """A parked job's record: the job as submitted, its place in the queue, and how many of
    its placements failed unexpectedly."""
    return json.dumps({"job": job, "score": score, "errors": errors})


def _queue(what: str) -> str:
    return keys.ORPHANS if what == "orphan" else keys.PARKED


def held_field(holder: str, job_id: str) -> str:
    """A held job's field in ``ggufq:in_hand`` (job ids never hold a "|")."""
    return f"{holder}|{job_id}"


@dataclass(frozen=True)
class Held:
    """A job a placement process holds, as :func:`sort_held` reads it."""

    holder: str
    job_id: str
    token: str
    what: str

    @property
    def field(self) -> str:
        return held_field(self.holder, self.job_id)


def sort_held(
    entries: dict[str, str], beats: dict[str, float], name: str, dead_before: float
) -> tuple[list[Held], list[Held]]:
    """Of the held jobs (``ggufq:in_hand`` as text) taken before ``dead_before``: those of
    other placement processes that have not beaten since then (``beats``: each one's last
    beat; a process gone has none), and those of ``name`` held that long, which no thread
    of it still decides on (Redis restored from an older snapshot gave it back a job it had
    long let go of; a thread that does still hold it finds it swept, as from a stalled
    holder), but not one it was ending. An entry that does not parse is another's, to be
    ended."""
    others, own = [], []
    for field, text in entries.items():
        holder, _, job_id = field.rpartition("|")
        try:
            entry = json.loads(text)
            token, what, at = str(entry["token"]), str(entry["what"]), float(entry["at"])
            ending = bool(entry.get("ending"))
        except (ValueError, KeyError, TypeError, AttributeError):
            token, what, at, ending = "", "parked", 0.0, False  # the sweep ends it
        if at >= dead_before:
            continue
        held = Held(holder, job_id, token, what)
        if holder == name:
            if not ending:  # one it is ending: its own thread writes the end
                own.append(held)
        elif beats.get(holder, 0.0) < dead_before:
            others.append(held)
    return others, own


class Hands:
    """The jobs one placement process (``name``, as it beats) has in hand."""

    def __init__(
        self, client: redis.Redis, name: str = "", streams: Shards[redis.Redis] | None = None
    ) -> None:
        self.r = client
        self.streams = streams or Shards(client)  # where the jobs' streams live
        self.name = name or f"placement-{uuid.uuid4().hex[:12]}"
        self._local = threading.local()
        self._place = script(client, "place")
        self._take = script(client, "take")
        self._sent = script(client, "sent")
        self._put_back = script(client, "put_back")
        self._let_go = script(client, "let_go")
        self._ending = script(client, "ending")
        self._sweep = script(client, "sweep")

    def field(self, job_id: str) -> str:
        return held_field(self.name, job_id)

    # -- tokens, per thread -------------------------------------------------------------------
    def _tokens(self) -> dict[str, str]:
        tokens = getattr(self._local, "tokens", None)
        if tokens is None:
            tokens = self._local.tokens = {}
        return cast(dict[str, str], tokens)

    def token(self, job_id: str) -> str:
        """The token this thread holds ``job_id`` under ('' when it does not hold it)."""
        return self._tokens().get(job_id, "")

    def hand_over(self, job_id: str) -> str:
        """The token of a job this thread holds, no longer this thread's: to be kept with
        the job (held through a Redis outage) and adopted by the thread that goes on. A
        script that lets go of a job (send, put back, let go) hands its token over only
        once Redis answered it, so that a job held after a failed one keeps its token."""
        return self._tokens().pop(job_id, "")

    def adopt(self, job_id: str, token: str) -> None:
        if token:
            self._tokens()[job_id] = token

    # -- taking in hand ---------------------------------------------------------------------
    def claim(
        self, job_id: str, delivery: str, ttl_s: int, record: str, read: list[str] | None = None
    ) -> tuple[bool, list[Any]]:
        """Claim a submission's placement for ``delivery`` (PlacementState.place_once) and
        hold it, its ``record`` as :func:`parked_record` makes it; False when another
        delivery has it. The values of the keys ``read`` come back with it, read in the
        same round trip."""
        token = self.token(job_id) or uuid.uuid4().hex
        self.adopt(job_id, token)
        entry = json.dumps({"token": token, "what": "parked", "record": record})
        # the same delivery asking again finds the claim its own
        owned, values = self._reading(
            self._place,
            [keys.job_placed(job_id), keys.IN_HAND, keys.job_custody(job_id)],
            [delivery, ttl_s, self.field(job_id), entry, token],
            read,
        )
        if not owned:
            self.hand_over(job_id)
        return bool(owned), values

    def _reading(
        self, registered: Any, keys_: list[str], args: list[Any], read: list[str] | None
    ) -> tuple[Any, list[Any]]:
        """A script's answer, and the values of the keys ``read`` (none: an empty list), in
        one round trip, asked again once if the connection was lost (again_if_lost)."""

        def run() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            queue(pipe, registered, keys_, args)
            if read:
                pipe.mget(read)
            return execute(pipe)

        replies = again_if_lost(run)
        return replies[0], list(replies[1]) if read else []

    def take(self, what: Taken, job_id: str, token: str = "") -> bytes | None:
        """Take a job's record out of the orphans or the parked queue (lua/take.lua) and
        hold it; None when another taker has it. A reply lost on the way is asked for again
        under the same token, so the record is neither lost with it nor handed to two
        takers; TakeUnsure when Redis does not answer that either. ``token``: a take asked
        again after one."""
        return self.take_reading(what, job_id, token)[0]

    def take_reading(
        self, what: Taken, job_id: str, token: str = "", read: list[str] | None = None
    ) -> tuple[bytes | None, list[Any]]:
        """:meth:`take`, and the values of the keys ``read``, read in the same round trip."""
        token = token or uuid.uuid4().hex
        self.adopt(job_id, token)
        try:
            raw, values = self._reading(
                self._take,
                [_queue(what), keys.parked_job(job_id), keys.IN_HAND, keys.job_custody(job_id)],
                [job_id, self.field(job_id), token, what],
                read,
            )
        except REDIS_AWAY as exc:
            self.hand_over(job_id)
            raise TakeUnsure(what, job_id, token, exc) from exc
        if not raw:
            self.hand_over(job_id)
            return None, []
        return cast(bytes, raw), values

    # -- letting go -------------------------------------------------------------------------
    def sent(self, record: SentJob, queue: str, message: str) -> bool:
        """Send a job to its device: its record and its Celery ``message`` on ``queue``,
        and let go of it, in one step (lua/sent.lua); False when another placement process
        swept it back from this one (it had stalled): it is not to be sent."""
        job_id, placement = record.job.id, record.placement
        token, raw = self.token(job_id), record.model_dump_json()
        done = again_if_lost(  # asked again, it finds the job sent and sends nothing more
            lambda: self._sent(
                keys=[
                    keys.inflight(placement.device_id),
                    keys.IN_HAND,
                    keys.job_custody(job_id),
                    queue,
                ],
                args=[
                    job_id,
                    raw,
                    placement.id,
                    self.field(job_id),
                    token,
                    placement.runner_id,
                    placement.device_id,
                    message,
                ],
            )
        )
        if not done:
            self.hand_over(job_id)
        # sent: its token stays this thread's until the job is off its path (the thread
        # hands it over), so that a park or an end of it tried meanwhile finds it sent
        return bool(done)

    def put_back(self, what: Taken, job_id: str, record: bytes | str) -> PutBack:
        """Park a job this thread holds (or any job: held or not, it is parked) or put an
        orphan back, and let go of it (:class:`PutBack` says what happened)."""
        token = self.token(job_id)
        done = again_if_lost(  # the same record put back twice is there once
            lambda: self._put_back(
                keys=[
                    _queue(what),
                    keys.parked_job(job_id),
                    keys.IN_HAND,
                    keys.job_custody(job_id),
                ],
                args=[job_id, what, record, self.field(job_id), token],
            )
        )
        self.hand_over(job_id)
        return PutBack(int(done))

    def ending(self, job_id: str) -> bool:
        """Whether this thread may end a job (fail or cancel it): it does not hold it, or
        holds it and it was neither put back by another placement process nor sent (its
        device runs it); then it is marked ending, so that a sweep after this process stops
        ends it too, not runs it."""
        token = self.token(job_id)
        if not token:
            return True
        ok = again_if_lost(
            lambda: self._ending(
                keys=[keys.IN_HAND, keys.job_custody(job_id)], args=[self.field(job_id), token]
            )
        )
        return bool(ok)

    def let_go(self, job_id: str) -> None:
        """Let go of a job this thread held and has ended (or found finished)."""
        token = self.token(job_id)
        if not token:
            return
        self.let_go_of(Held(self.name, job_id, token, ""))
        self.hand_over(job_id)

    # -- the jobs of placement processes gone ------------------------------------------------
    def look(self, dead_before: float) -> tuple[list[Held], list[Held]]:
        """:func:`sort_held` on what Redis holds now: the jobs of silent placement
        processes, and this one's held too long."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.IN_HAND)
        pipe.zrange(keys.PLACEMENT_ALIVE, 0, -1, withscores=True)
        raw, beats = pipe.execute()
        if not raw:
            return [], []
        last_beats = {name.decode(errors="replace"): beat for name, beat in beats}
        # bytes that are not UTF-8 make an entry that does not parse, not a loop that fails
        entries = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
        return sort_held(entries, last_beats, self.name, dead_before)

    def let_go_of(self, held: Held) -> None:
        """Let go of ``held`` (under its holder's field and token)."""
        again_if_lost(lambda: self._let_go(keys=[keys.IN_HAND], args=[held.field, held.token]))

    def sweep(
        self, held: Held, dead_before: float, finished: bool, ends: tuple[str, str], ttl_s: int
    ) -> Swept:
        """Put ``held`` back in its queue, once, if its holder is still silent (or is this
        process: an entry of its own held past ``dead_before``), or let go of it
        (:class:`Swept` says which). A job its holder was ending, or whose entry does not
        parse, is ended in the same step with the final chunk ``ends`` gives for each (JSON
        objects without a seq; its stream kept ``ttl_s``)."""
        outcome = self._sweep(
            keys=[
                keys.IN_HAND,
                keys.PLACEMENT_ALIVE,
                _queue(held.what),
                keys.parked_job(held.job_id),
                keys.job_custody(held.job_id),
            ],
            args=[
                held.field,
                held.token,
                held.holder,
                dead_before,
                held.job_id,
                int(finished),
                int(held.holder == self.name),
                *ends,
                ttl_s,
                int(self.streams.sharded),
            ],
        )
        swept = Swept(int(outcome))
        if self.streams.sharded and swept in (Swept.ENDING, Swept.UNREADABLE):
            chunk = json.loads(ends[0] if swept is Swept.ENDING else ends[1])
            write = partial(write_final, job_id=held.job_id, chunk=chunk, ttl_s=ttl_s)
            pay(self.r, self.streams, held.job_id, write)  # else owed, for the next look
        return swept

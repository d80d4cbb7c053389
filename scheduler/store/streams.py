"""Token chunks of a job: published on Redis pub/sub, recorded in a replayable stream.

Every chunk carries ``seq`` (1, 2, ...). The stream's entry ids are ``0-<seq>``, so a reader
that subscribed late, or lost its connection, reads what it missed with one XRANGE and then
follows the channel: nothing is lost and nothing is seen twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from enum import IntEnum
from functools import partial
from typing import Any, cast

import redis

from scheduler.custody import JobState
from scheduler.errors import GgufqError, JobCancelled
from scheduler.midstream import SoFar
from scheduler.store import keys
from scheduler.store.scripts import queue, script
from scheduler.store.shards import Shards

Entries = list[tuple[bytes, dict[bytes, bytes]]]
log = logging.getLogger(__name__)


class Appended(IntEnum):
    """What lua/append.lua did with a chunk (its header cites these values)."""

    WRITTEN = 1
    FENCED = 0  # not written: the job's custody record names another holder now
    DUPLICATE = -1  # not written again: the stream has this seq already


def outcome_of(chunk: dict[str, Any] | None) -> str:
    """The state a job ends in with ``chunk``, as the scripts that write it take it (its
    custody record moves there when the chunk is written); "" for a chunk that is not
    final."""
    if not chunk or not chunk.get("done"):
        return ""
    if chunk.get("done_reason") == "cancel":
        return JobState.CANCELLED.value
    return (JobState.FAILED if chunk.get("error") else JobState.DONE).value


def _append_call(
    job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str
) -> tuple[list[str], list[Any]]:
    """lua/append.lua's keys and arguments for one chunk: written only while the job's
    custody record's holder is ``fence`` (a placement id; "" always writes)."""
    keys_, args = chunk_call(job_id, seq, chunk, ttl_s, fence)
    return [*keys_, keys.job_custody(job_id)], [*args, outcome_of(chunk)]


def chunk_call(
    job_id: str, seq: int, chunk: dict[str, Any] | None, ttl_s: int, fence: str
) -> tuple[list[str], list[Any]]:
    """The stream and channel keys and the fence, seq, payload and ttl arguments of a
    script that writes a job's chunk among other things (lua/end.lua); ``chunk`` None
    writes none."""
    payload = "" if chunk is None else json.dumps(dict(chunk, seq=seq))
    job_keys = [keys.job_chunks(job_id), keys.job_channel(job_id)]
    return job_keys, [fence, seq, payload, ttl_s]


def write_chunk(
    client: redis.Redis, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> Appended:
    """Record and publish one chunk (lua/append.lua) in one round trip."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    return Appended(int(_registered(client, "append")(keys=job_keys, args=args, client=client)))


def append_command(
    client: Any, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> tuple[Any, ...]:
    """:func:`write_chunk` as one EVALSHA command's arguments, to send on a connection whose
    answer is read later (workers/first_chunk.py): it is :class:`Appended`, or NOSCRIPT
    when Redis lost the script (then write the chunk the usual way)."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    return ("EVALSHA", _registered(client, "append").sha, len(job_keys), *job_keys, *args)


def queue_chunk(
    pipe: Any, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
) -> None:
    """:func:`write_chunk` queued on a pipeline by the script's hash alone (run the pipeline
    with :func:`scheduler.store.scripts.execute`; append.lua skips a chunk already there)."""
    job_keys, args = _append_call(job_id, seq, chunk, ttl_s, fence)
    queue(pipe, _registered(pipe, "append"), job_keys, args)


_REGISTERED: dict[str, Any] = {}  # name → the registered script, made on first use


def _registered(client: Any, name: str) -> Any:
    if name not in _REGISTERED:
        _REGISTERED[name] = script(client, name)
    return _REGISTERED[name]


def error_chunk(model: str, job_id: str, exc: GgufqError, **fields: Any) -> dict[str, Any]:
    """The final chunk of a job that failed or was cancelled (the reader raises ``exc``)."""
    reason = "cancel" if isinstance(exc, JobCancelled) else "error"
    return dict(
        fields,
        model=model,
        job_id=job_id,
        created_at=time.time(),
        response="",
        done=True,
        done_reason=reason,
        error={"code": exc.code, "message": str(exc)},
    )


def progress(client: redis.Redis, job_id: str) -> tuple[int, bool]:
    """(chunks recorded so far, whether the final one is among them)."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.job_chunks(job_id))
    pipe.xrevrange(keys.job_chunks(job_id), count=1)
    count, last = pipe.execute()
    return int(count), final_seq(last) is not None


def so_far(client: redis.Redis, job_id: str) -> SoFar:
    """What a job's stream holds of its answer (a resumed run goes on from there)."""
    entries = cast(Entries, client.xrange(keys.job_chunks(job_id)))
    return SoFar.of([json.loads(fields[b"c"]) for _id, fields in entries])


def final_seq(last: Entries) -> int | None:
    """The seq of the stream's final chunk, when its last entry (XREVRANGE COUNT 1) is one."""
    if not last:
        return None
    entry, fields = last[0]
    return int(entry.split(b"-")[1]) if json.loads(fields[b"c"]).get("done") else None


def publish_final(
    client: redis.Redis,
    job_id: str,
    chunk: dict[str, Any],
    ttl_s: int,
    shards: Shards[redis.Redis] | None = None,
) -> Appended:
    """End a job from a process that published nothing before it (placement fails or
    cancels it): its final chunk after whatever its stream holds, and out of the parked
    queue if it waits there, in one step (lua/final.lua). Where the stream lives on a
    Redis of its own (``shards``), the job's record moves first, the chunk owed, and the
    chunk follows (:func:`pay`). FENCED, with nothing written, when the job's custody
    record says it runs or ended otherwise (the custody table refuses the move);
    DUPLICATE when it ended so already (asked again: its final chunk is there, or owed)."""
    final = dict(chunk, done=True)
    args = [job_id, json.dumps(final), ttl_s, outcome_of(final)]
    if shards is None or not shards.sharded:
        return Appended(int(_registered(client, "final")(keys=[], args=args, client=client)))
    moved = Appended(int(_registered(client, "final")(keys=[], args=[*args, "1"], client=client)))
    if moved is Appended.WRITTEN:
        pay(client, shards, job_id, lambda stream: write_final(stream, job_id, final, ttl_s))
    return moved


def write_final(stream: redis.Redis, job_id: str, chunk: dict[str, Any], ttl_s: int) -> Appended:
    """A final chunk after whatever the job's stream holds, on the stream's own Redis
    (lua/final.lua there), whose record then names no holder: a later chunk of any run
    is refused. A stream that ended already gets none (DUPLICATE)."""
    final = dict(chunk, done=True)
    args = [job_id, json.dumps(final), ttl_s, outcome_of(final), "2"]
    return Appended(int(_registered(stream, "final")(keys=[], args=args, client=stream)))


def claim_stream(
    stream: redis.Redis, job_id: str, placement_id: str, epoch: int, force: bool = False
) -> int:
    """A run's claim, under its custody ``epoch``, on its job's stream where the stream
    lives apart (lua/stream_claim.lua): the seq of the stream's last chunk (0: none), -1
    when the stream has ended, -2 when it was claimed or fenced under a later epoch."""
    found = _registered(stream, "stream_claim")(
        keys=[keys.job_chunks(job_id), keys.job_custody(job_id)],
        args=[placement_id, epoch, "1" if force else ""],
        client=stream,
    )
    return int(found)


def fence_stream(stream: redis.Redis, job_id: str, epoch: int) -> tuple[int, bool]:
    """Placement takes a job from its run where its stream lives apart
    (lua/stream_fence.lua): no run writes there until the next one claims it; (chunks the
    stream holds, whether its last is a final one), read in the same step."""
    count, final = _registered(stream, "stream_fence")(
        keys=[keys.job_chunks(job_id), keys.job_custody(job_id)],
        args=[epoch],
        client=stream,
    )
    return int(count), bool(final)


def write_owed(
    stream: redis.Redis, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str
) -> Appended:
    """A job's final chunk its end (on the control Redis, fenced there) owes its stream's
    own Redis: at its seq under ``fence``; where that Redis's record names no holder or
    another (placement fenced it, or a claim came in between: the custody record, which
    ended the job under this run, decides), after whatever the stream holds."""
    written = write_chunk(stream, job_id, seq, chunk, ttl_s, fence)
    if written is Appended.FENCED:
        return write_final(stream, job_id, chunk, ttl_s)
    return written


def pay(
    control: redis.Redis,
    shards: Shards[redis.Redis],
    job_id: str,
    write: Callable[[redis.Redis], Appended],
) -> Appended | None:
    """Write a job's owed final chunk with ``write`` on its stream's Redis, and say so
    (ggufq:due:final); None when that Redis did not take it: it stays owed, for
    placement's look (:func:`pay_owed`)."""
    try:
        written = write(shards.of(job_id))
    except redis.RedisError as exc:
        log.warning("job %s: its final chunk stays owed to its stream's Redis (%s)", job_id, exc)
        return None
    _paid(control, job_id)
    return written


def _paid(control: redis.Redis, job_id: str) -> None:
    pipe = control.pipeline(transaction=False)
    pipe.zrem(keys.DUE_FINAL, job_id)
    pipe.hdel(keys.job_custody(job_id), "owed")
    pipe.execute()


def pay_owed(control: redis.Redis, shards: Shards[redis.Redis], before: float, ttl_s: int) -> int:
    """Write the final chunks owed since before ``before`` (Redis's clock) to streams on
    Redis instances of their own: their writer stopped between the job's end and its
    chunk (a worker killed there), or that Redis was away, and a reader would wait for it
    in vain. A chunk with its seq goes there fenced by the job's holder (one written
    meanwhile is refused as a duplicate), one without after whatever the stream holds
    (none after a final one). Returns how many were written."""
    members = cast(
        list[bytes], control.zrangebyscore(keys.DUE_FINAL, "-inf", f"({before}", 0, 1000)
    )
    pipe = control.pipeline(transaction=False)
    for member in members:
        pipe.hmget(keys.job_custody(member.decode()), "owed", "holder")
    written, away = 0, set()  # the instances found away: not asked again in this look
    for member, (owed, holder) in zip(members, pipe.execute(), strict=True):
        job_id = member.decode()
        if owed is None:  # written meanwhile
            _paid(control, job_id)
            continue
        if id(shards.of(job_id)) in away:
            continue
        chunk = json.loads(owed)
        log.warning("job %s: writing its final chunk, which its writer left owed", job_id)
        write: Callable[[redis.Redis], Appended]
        if "seq" in chunk:
            seq, fence = int(chunk.pop("seq")), (holder or b"").decode()
            write = partial(
                write_owed, job_id=job_id, seq=seq, chunk=chunk, ttl_s=ttl_s, fence=fence
            )
        else:
            write = partial(write_final, job_id=job_id, chunk=chunk, ttl_s=ttl_s)
        if pay(control, shards, job_id, write) is None:
            away.add(id(shards.of(job_id)))
        else:
            written += 1
    return written

"""Streams that outlive their connection and their gateway (llama.cpp's shape: a request
with ``X-Conversation-Id``, then ``GET /v1/stream/{id}?from=N``).

- A streamed request that carries ``X-Conversation-Id`` gets a stream any gateway can pick
  up again. At its start the gateway keeps the request that made it (path, body, tenant,
  when its job was submitted) beside the job's chunks and for as long (GGUFQ_STREAM_TTL_S),
  under the job's id and, for the tenant, under the conversation's name (the latest stream
  of that name wins). The answer names both (``X-Ggufq-Job``, ``X-Conversation-Id``).
- Each chunk's last SSE event carries ``id: <seq>``, the chunk's place in the job's stream
  (an Ollama NDJSON stream has no ids: its chunk lines are seq 1, 2, ... in order).
- A client that goes away does not cancel the job: its reader's lease lapses after
  GGUFQ_HTTP_READER_LEASE_S, and only then is the job cancelled, unless a reader picked the
  stream up meanwhile.
- ``GET /v1/stream/{id}`` (api_client/gateway/stream_api.py) makes the kept request again,
  attached to its job instead of submitting one (:class:`Resume`, read by
  ``Gateway.submit``), and sends the frames of the chunks from ``from`` on (or after the
  ``Last-Event-ID`` header): its encoder sees every chunk from the first, so what it sends
  is what the first answer would have sent next, nothing repeated.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import redis

from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from scheduler.errors import InvalidRequest
from scheduler.store import keys

log = logging.getLogger(__name__)
CONVERSATION = b"x-conversation-id"
BODY = "ggufq.body"  # the scope's key for the body of a request that asked to be resumable
NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
MAX_KEPT_BYTES = 4 << 20  # a larger request streams as one that cannot be picked up again


@dataclass(frozen=True, slots=True)
class Resume:
    """A stream picked up again: the job its request made, the first chunk to send, and
    the name it was asked for by."""

    job_id: str
    submitted_at: float
    from_seq: int
    name: str = ""

    def attach(self, client: AsyncClient, model: str, prompt: str, **fields: Any) -> AsyncJob:
        """The handle of the job the kept request made (its arguments as then), not sent."""
        extra = {**fields.pop("extra", {}), "id": self.job_id, "submitted_at": self.submitted_at}
        return client.attach(model, prompt, **fields, extra=extra)


@dataclass(frozen=True, slots=True)
class Kept:
    """A resumable stream's request, as the gateway kept it."""

    job_id: str
    path: str
    body: bytes
    tenant: str
    submitted_at: float


@dataclass(slots=True)
class StreamIds:
    """A resumable answer's frames: those of chunks before ``from_seq`` left out, and each
    chunk's last frame marked with its place: an SSE event's id ``<job id>.<seq>`` (so
    that an id from another stream of the same name is told apart), an NDJSON line's
    ``seq`` field."""

    job_id: bytes
    from_seq: int
    sse: bool

    def frames(self, frames: list[bytes], seq: int | None) -> list[bytes]:
        if seq is not None and seq < self.from_seq:
            return []
        if seq is None or not frames:
            return frames
        last = frames[-1]
        if self.sse:
            marked = b"id: %s.%d\n" % (self.job_id, seq) + last
        elif last.startswith(b"{"):
            marked = b'{"seq":%d,' % seq + last[1:]
        else:
            marked = last
        return [*frames[:-1], marked]


def asked(scope: MutableMapping[str, Any], body: bytes) -> None:
    """Keep on its scope the body of a request that asks for a resumable stream (before
    its job is made: a name that cannot be one is refused first)."""
    for header, value in scope.get("headers", ()):
        if header == CONVERSATION:
            scope[BODY] = (conversation_name(value.decode("latin-1").strip()), body)
            return


def conversation_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise InvalidRequest(
            f"X-Conversation-Id {name[:40]!r}: give 1 to 128 letters, digits or . _ : @ - "
            "(it names the stream in GET /v1/stream/{id})"
        )
    return name


async def opened(
    scope: MutableMapping[str, Any], job: AsyncJob, sse: bool
) -> tuple[StreamIds, str] | None:
    """A streamed answer as it begins: how it is resumable (and the conversation's name for
    its header), or None for one that is not. A stream picked up again is resumable; one
    asked to be has its request kept first (a stream of several jobs, ``n`` choices, is
    not: picking it up would need all of them)."""
    caller = scope.get("state", {}).get("caller")
    resume: Resume | None = getattr(caller, "resume", None)
    if resume is not None:
        return StreamIds(job.id.encode(), resume.from_seq, sse), resume.name or job.id
    asking = scope.pop(BODY, None)  # not held while the answer waits
    if asking is None or type(job) is not AsyncJob:
        return None
    name, body = asking
    if len(body) > MAX_KEPT_BYTES:
        log.warning(
            "job %s's request is over %d bytes: not kept to be picked up", job.id, len(body)
        )
        return None
    tenant = getattr(caller, "tenant", "default")
    try:
        await keep(job, scope["path"], body, tenant, name)
    except redis.RedisError as exc:  # the stream goes on, as one that cannot be resumed
        log.warning("job %s's stream cannot be picked up again: %s", job.id, exc)
        return None
    return StreamIds(job.id.encode(), 1, sse), name


async def keep(job: AsyncJob, path: str, body: bytes, tenant: str, name: str) -> None:
    """Keep the request beside the job's chunks, with its reader's lease: a client that
    leaves before its lease's first renewal still leaves a lease to lapse, and its job is
    cancelled unless the stream is picked up."""
    ttl_s = job.client.settings.stream_ttl_s
    record = {"path": path, "body": body, "tenant": tenant, "at": repr(job.submitted_at)}
    pipe = job.client.r.pipeline(transaction=False)
    lease = job.job.reader_lease(cancel_on_close=True)
    assert lease is not None  # a reader that cancels on close has one
    lease.renew(pipe, time.monotonic())
    pipe.hset(keys.job_http(job.id), mapping=record)  # type: ignore[arg-type]
    pipe.expire(keys.job_http(job.id), ttl_s)
    pipe.set(keys.conversation(tenant, name), job.id, ex=ttl_s)
    await pipe.execute()


async def find(r: Any, tenant: str, name: str) -> Kept | None:
    """The kept request of stream ``name``: the tenant's conversation of that name, else the
    job of that id."""
    job_id = await r.get(keys.conversation(tenant, conversation_name(name)))
    job_id = job_id.decode() if job_id else name
    raw = await r.hgetall(keys.job_http(job_id))
    try:
        path, tenant, at = raw[b"path"].decode(), raw[b"tenant"].decode(), float(raw[b"at"])
        return Kept(job_id, path, raw[b"body"], tenant, at)
    except (KeyError, ValueError):  # none kept (or not whole): nothing to pick up
        return None

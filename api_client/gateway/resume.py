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
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import redis

from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from scheduler.store import keys

log = logging.getLogger(__name__)
CONVERSATION = b"x-conversation-id"
BODY = "ggufq.body"  # the scope's key for the body of a request that asked to be resumable
MAX_NAME = 128


@dataclass(frozen=True, slots=True)
class Resume:
    """A stream picked up again: the job its request made, and the first chunk to send."""

    job_id: str
    submitted_at: float
    from_seq: int

    def attach(self, client: AsyncClient, model: str, prompt: str, **fields: Any) -> AsyncJob:
        """The handle of the job the kept request made (its arguments as then), not sent."""
        extra = {**(fields.pop("extra", None) or {}), "id": self.job_id}
        extra["submitted_at"] = self.submitted_at
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
    chunk's last SSE event given the chunk's seq as its id."""

    from_seq: int
    sse: bool

    def frames(self, frames: list[bytes], seq: int | None) -> list[bytes]:
        if seq is not None and seq < self.from_seq:
            return []
        if not self.sse or seq is None or not frames:
            return frames
        return [*frames[:-1], b"id: %d\n" % seq + frames[-1]]


def asked(scope: MutableMapping[str, Any], body: bytes) -> None:
    """Keep on its scope the body of a request that asks for a resumable stream."""
    for name, value in scope.get("headers", ()):
        if name == CONVERSATION:
            scope[BODY] = (value.decode("latin-1").strip()[:MAX_NAME], body)
            return


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
        return StreamIds(resume.from_seq, sse), ""
    asking = scope.get(BODY)
    if asking is None or type(job) is not AsyncJob:
        return None
    name, body = asking
    tenant = getattr(caller, "tenant", "default")
    try:
        await keep(job, scope["path"], body, tenant, name)
    except redis.RedisError as exc:  # the stream goes on, as one that cannot be resumed
        log.warning("job %s's stream cannot be picked up again: %s", job.id, exc)
        return None
    return StreamIds(0, sse), name or job.id


async def keep(job: AsyncJob, path: str, body: bytes, tenant: str, name: str) -> None:
    r, ttl_s = job.client.r, job.client.settings.stream_ttl_s
    record: dict[str, bytes | str] = {"path": path, "body": body, "tenant": tenant}
    record["at"] = repr(job.submitted_at)
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.job_http(job.id), mapping=record)  # type: ignore[arg-type]
    pipe.expire(keys.job_http(job.id), ttl_s)
    if name:
        pipe.set(keys.conversation(tenant, name), job.id, ex=ttl_s)
    await pipe.execute()


async def find(r: Any, tenant: str, name: str) -> Kept | None:
    """The kept request of stream ``name``: the tenant's conversation of that name, else the
    job of that id."""
    job_id = await r.get(keys.conversation(tenant, name[:MAX_NAME]))
    job_id = job_id.decode() if job_id else name
    raw = await r.hgetall(keys.job_http(job_id))
    if not raw or b"body" not in raw:
        return None
    return Kept(
        job_id,
        raw[b"path"].decode(),
        raw[b"body"],
        raw[b"tenant"].decode(),
        float(raw[b"at"]),
    )

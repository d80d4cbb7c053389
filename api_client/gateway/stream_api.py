"""``GET /v1/stream/{id}``: a resumable stream picked up again, on any gateway
(api_client/gateway/resume.py says how a stream becomes resumable).

``id`` is the stream's ``X-Conversation-Id`` (the caller's latest stream of that name) or
its job's id (``X-Ggufq-Job``). The frames sent are those of the job's chunks from seq
``from`` on (the query), or after the ``Last-Event-ID`` header's seq; without either, from
the first; 204 when the job's stream ended before that chunk. The answer has the shape of
the request that made the stream (an OpenAI chat completion's events, Anthropic's, an
Ollama NDJSON stream ...).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from api_client.gateway import anthropic_api, ollama, openai_api
from api_client.gateway.caller import caller_of
from api_client.gateway.core import Routes, gateway_of
from api_client.gateway.resume import Resume, find
from scheduler.errors import Conflict, InvalidRequest, NotFound
from scheduler.store import keys
from scheduler.store.streams import final_seq

router = Routes(prefix="/v1")

# the endpoints whose streams can be picked up again: every one that streams a job
RESUMABLE = {
    route.path: route.endpoint
    for routes in (openai_api.router, anthropic_api.router, ollama.router)
    for route in routes.routes
    if "POST" in (route.methods or ())
}


@router.add("/stream/{stream_id}", "GET")
async def stream(request: Request) -> Any:
    gateway, caller = gateway_of(request), caller_of(request)
    name = request.path_params["stream_id"]
    kept = await find(gateway.client.r, caller.tenant, name)
    if kept is None or not caller.sees(kept.tenant) or kept.path not in RESUMABLE:
        raise NotFound(
            f"no stream {name!r} to pick up: a stream can be picked up again when its "
            "request carried X-Conversation-Id, for GGUFQ_STREAM_TTL_S after it began, by "
            "its own API key; name it by that header's value or by its X-Ggufq-Job"
        )
    start = first_seq(request, kept.job_id)
    if await ended_before(gateway.client.streams.of(kept.job_id)[0], kept.job_id, start):
        return Response(status_code=204)  # nothing after: an EventSource stops asking
    resumed = replace(caller, resume=Resume(kept.job_id, kept.submitted_at, start, name))
    request.scope["state"]["caller"] = resumed  # the answer reads it as it begins
    scope = {**request.scope, "method": "POST", "path": kept.path, "query_string": b""}
    sent = False

    async def receive() -> Message:  # the kept body, as the first request sent it
        nonlocal sent
        if sent:
            return await request.receive()
        sent = True
        return {"type": "http.request", "body": kept.body, "more_body": False}

    return await RESUMABLE[kept.path](Request(scope, receive))


async def ended_before(r: Any, job_id: str, seq: int) -> bool:
    """Whether the job's stream ended with a chunk before ``seq``: there is nothing to send."""
    final = final_seq(await r.xrevrange(keys.job_chunks(job_id), count=1))
    return final is not None and final < seq


def first_seq(request: Request, job_id: str) -> int:
    """The first chunk to send: ``from``, else the one after ``Last-Event-ID`` (an SSE
    event's id, ``<job id>.<seq>``, or a bare seq), else 1. An id of another job (the
    conversation's name went on to a newer stream) is refused: its seq means nothing here."""
    given = request.query_params.get("from")
    last = request.headers.get("last-event-id")
    try:
        if given is not None:
            return max(1, int(given))
        if last:
            of, _, seq = last.strip().rpartition(".")
            if of and of != job_id:
                raise Conflict(
                    f"Last-Event-ID {last!r} is an event of job {of}, and this stream's job "
                    f"is {job_id}: the conversation's name went on to a newer stream; pick "
                    f"up job {of} by its id (GET /v1/stream/{of})"
                )
            return max(1, int(seq) + 1)
    except ValueError:
        raise InvalidRequest(
            f"from={given!r} / Last-Event-ID {last!r}: give a chunk's seq, a whole number, "
            "or an SSE event's id as the stream sent it"
        ) from None
    return 1

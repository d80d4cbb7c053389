"""AsyncClient against the real stack, and streams that are read late or dropped and reopened
(sync and async): no chunk lost, none seen twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from api_client import (
    AsyncClient,
    Client,
    GenerateResponse,
    InvalidRequest,
    JobCancelled,
    ModelNotFound,
)
from api_client.ajob import AsyncJob
from api_client.job import Job
from scheduler.local.stack import LocalStack
from scheduler.protocol import JobRequest
from scheduler.settings import Settings
from scheduler.store import keys
from tests.conftest import wait_for

GREEDY = {"temperature": 0, "num_predict": 16, "seed": 7}
LONG = {"temperature": 0, "num_predict": 1500}  # the tiny model stops after ~94 tokens
T = TypeVar("T")


def run(stack: LocalStack, settings: Settings, body: Callable[[AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with AsyncClient(stack.redis_url, settings=settings, timeout=60) as client:
            return await body(client)

    return asyncio.run(main())


async def until(predicate: Callable[[], Awaitable[object]], timeout: float = 20.0) -> bool:
    """``wait_for`` for a condition read through the async client."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(await predicate())


def text_of(chunks: list[GenerateResponse]) -> str:
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    return "".join(c.response for c in chunks[:-1])


# -- streams: late readers and reconnects -------------------------------------------------
def test_stream_read_after_the_job_finished_replays_everything(client: Client) -> None:
    job = client.submit("tiny", "Once upon a time", options=GREEDY)
    final = job.result()
    chunks = list(job.stream())
    assert text_of(chunks) == final.response
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))


def test_stream_dropped_and_reopened_after_last_seq(client: Client) -> None:
    job = client.submit("tiny", "Once upon a time", options={**GREEDY, "num_predict": 64})
    first = job.stream(cancel_on_close=False)
    # a chunk holds the tokens that waited for the worker's writer together, so a fast
    # model may send only a few: one, then the rest after it, is what every job has
    seen = [next(first)]
    first.close()  # the reader goes away; the job goes on
    last = seen[-1].seq
    assert last == 1 and not seen[-1].done
    rest = list(job.stream(after=last))
    assert rest[0].seq == last + 1
    assert "".join(c.response for c in seen) + text_of(rest) == job.result().response


# -- AsyncClient ---------------------------------------------------------------------------
def test_async_generate_stream_and_result(
    stack: LocalStack, settings: Settings, client: Client
) -> None:
    expected = client.generate("tiny", "The sky is", options=GREEDY)

    async def body(c: AsyncClient) -> None:
        chunks = [
            ch async for ch in await c.generate("tiny", "The sky is", stream=True, options=GREEDY)
        ]
        assert text_of(chunks) == expected.response
        # a result is stored once its slot is free again (the stream's end may come first)
        result = await c.generate("tiny", "The sky is", options=GREEDY)
        assert result.response == expected.response and result.eval_count
        job = await c.submit("tiny", "The sky is", options=GREEDY)
        assert (await job.result()).response == expected.response
        assert await job.status() == "SUCCESS"
        # the runner was resident with a free slot: sent from the event loop, on the fast
        # path, as the sync client would have
        assert (await c.r.get(keys.job_placed(job.id))).startswith(b"fast:")
        assert "placement_received" not in await job.hops()
        with pytest.raises(InvalidRequest, match="already taken"):
            await c.submit("tiny", "again", extra={"id": job.id})
        # a late reader, then one that drops and resumes after the last seq it saw
        late = [ch async for ch in job.stream()]
        assert text_of(late) == expected.response
        resumed = [ch async for ch in job.stream(after=1)]
        assert [(c.seq, c.response) for c in resumed] == [(c.seq, c.response) for c in late[1:]]

    run(stack, settings, body)


def test_an_async_submit_cancelled_as_its_job_goes_out_cancels_the_job(
    stack: LocalStack, settings: Settings, client: Client
) -> None:
    """A caller that leaves (its task cancelled) while the fast path's script runs gets no
    handle: the job, sent, would run for nobody, so it is cancelled."""
    client.generate("tiny", "warm", options={"num_predict": 2})  # resident: the fast path

    async def body(c: AsyncClient) -> None:
        assert c.fast is not None
        send = c.fast._send

        async def sent_then_left(**kw: object) -> object:
            await send(**kw)
            raise asyncio.CancelledError  # its reply never read: the caller left

        c.fast._send = sent_then_left
        with pytest.raises(asyncio.CancelledError):
            await c.submit("tiny", "left behind", options=LONG, extra={"id": "left-behind"})

    run(stack, settings, body)
    assert client.r.get(keys.job_placed("left-behind")).startswith(b"fast:")
    with pytest.raises(JobCancelled):
        Job(client, JobRequest(id="left-behind", model="tiny")).result(timeout=30)


def test_an_async_submit_cancelled_while_celery_sends_its_job_cancels_the_job(
    stack: LocalStack, settings: Settings, client: Client
) -> None:
    """The same on the normal path, whose sending runs in a thread: it finishes, and the
    job it sent is cancelled."""

    async def body(c: AsyncClient) -> None:
        send = c.sync.send_to_placement

        def slow_send(request: JobRequest) -> None:
            time.sleep(0.5)  # the caller leaves meanwhile
            send(request)

        c.sync.send_to_placement = slow_send  # type: ignore[method-assign]
        options = {**LONG, "num_gpu": 0}  # asks for GPU layers: placement's to place
        submit = asyncio.ensure_future(
            c.submit("tiny", "left behind", options=options, extra={"id": "left-placed"})
        )
        await asyncio.sleep(0.2)
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit

    run(stack, settings, body)
    with pytest.raises(JobCancelled):
        Job(client, JobRequest(id="left-placed", model="tiny")).result(timeout=30)


def test_async_jobs_run_concurrently(stack: LocalStack, settings: Settings) -> None:
    async def body(c: AsyncClient) -> list[str]:
        jobs = await asyncio.gather(
            *(c.submit("tiny", f"{n} + {n} =", options=GREEDY) for n in range(6))
        )
        assert len({j.id for j in jobs}) == 6
        results = await asyncio.gather(*(j.result() for j in jobs))
        return [r.response for r in results]

    responses = run(stack, settings, body)
    with Client(stack.redis_url, settings=settings) as sync:
        assert responses == [
            sync.generate("tiny", f"{n} + {n} =", options=GREEDY).response for n in range(6)
        ]


def test_async_chat_and_embed(stack: LocalStack, settings: Settings, client: Client) -> None:
    messages = [{"role": "user", "content": "the sky is"}]
    expected = client.chat("tiny", messages, options=GREEDY)

    async def body(c: AsyncClient) -> None:
        answer = await c.chat("tiny", messages, options=GREEDY)
        assert answer.message is not None and answer.message.content == expected.response
        chunks = [ch async for ch in await c.chat("tiny", messages, stream=True, options=GREEDY)]
        assert text_of(chunks) == expected.response
        embedded = await c.embed("tiny", ["hello there", "a different text"], keep_alive=0)
        assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 64
        with pytest.raises(InvalidRequest, match="chat job needs messages"):
            await c.chat("tiny", [])

    run(stack, settings, body)


def test_async_cancel_and_leaving_a_stream(stack: LocalStack, settings: Settings) -> None:
    async def body(c: AsyncClient) -> None:
        queued = await c.submit("tiny", "Count to a thousand:", options=LONG)
        await queued.cancel()
        with pytest.raises(JobCancelled):
            await queued.result()
        assert await queued.status() == "REVOKED"
        # The tiny model ends this answer within milliseconds, so whether the job ends
        # cancelled races with it; what the client owes is the cancel request.
        left = await c.submit("tiny", "Count to a thousand:", options=LONG)
        async for chunk in left.stream():
            if chunk.seq == 1:
                break  # as a client that goes away: the collected stream cancels the job
        assert await until(lambda: c.r.exists(keys.cancel_flag(left.id)))
        closed = await c.submit("tiny", "Count to a thousand:", options=LONG)
        stream = closed.stream()
        assert (await anext(stream)).seq == 1
        await stream.aclose()
        assert await c.r.exists(keys.cancel_flag(closed.id))
        kept = await c.submit("tiny", "Count to a thousand:", options=LONG)
        stream = kept.stream(cancel_on_close=False)
        assert (await anext(stream)).seq == 1
        await stream.aclose()
        assert (await kept.result()).done and not await c.r.exists(keys.cancel_flag(kept.id))
        with pytest.raises(ModelNotFound, match="'nope' not found"):
            await c.generate("nope", "hi")

    run(stack, settings, body)


def test_a_reader_cancelled_whose_cancel_fails_lets_go_once(
    stack: LocalStack, settings: Settings
) -> None:
    """The reading task is cancelled (its client left), and the job's cancel is refused
    (a replica during a failover): the reader still lets its lease go, once, to lapse, and
    its close afterwards asks nothing more."""

    async def body(c: AsyncClient) -> None:
        cancels: list[str] = []
        kept: list[bool] = []

        async def refused(job_id: str) -> None:
            cancels.append(job_id)
            raise redis.ReadOnlyError("You can't write against a read only replica.")

        let_go = c.leases.let_go
        c.cancel = refused  # type: ignore[method-assign]
        c.leases.let_go = lambda lease, keep=False: (kept.append(keep), let_go(lease, keep))  # type: ignore[method-assign]
        job = AsyncJob(c, Job(c.sync, JobRequest(model="tiny", prompt="never sent"), False))
        reader = job.reader(timeout=30)
        reading = asyncio.ensure_future(reader.__anext__())

        async def subscribed() -> bool:
            return bool((await c.r.pubsub_numsub(keys.job_channel(job.id)))[0][1])

        assert await until(subscribed)  # it waits for a chunk
        reading.cancel()
        with pytest.raises(redis.ReadOnlyError):
            await reading
        await reader.aclose()
        assert cancels == [job.id] and kept == [True]

    run(stack, settings, body)


def test_async_state_load_unload_and_batch(
    stack: LocalStack, settings: Settings, tmp_path: Path
) -> None:
    async def body(c: AsyncClient) -> None:
        health = await c.health()
        assert health["ok"] and health["devices"] >= 1
        devices = await c.devices()
        assert "cpu:testhost" in [d.id for d in devices]
        names = {m["name"]: m for m in await c.models()}
        assert names["tiny"]["architecture"] == "llama" and "notgguf" in names
        loaded = await c.load("tiny", keep_alive=-1, options={"num_ctx": 512})
        assert loaded.done_reason == "load"
        assert 512 in [r.context_length for r in await c.ps() if r.model == "tiny"]
        assert await c.jobs() == []
        assert await c.unload("tiny")
        out = tmp_path / "o.jsonl"
        summary = await c.batch("tiny", ["a", "b", "c"], output=out, options=GREEDY)
        assert (summary.done, summary.failed, summary.output) == (3, 0, str(out))

    run(stack, settings, body)
    with Client(stack.redis_url, settings=settings) as sync:
        assert wait_for(lambda: all(r.context_length != 512 for r in sync.ps()))


def test_cancelling_an_async_batch_cancels_its_jobs(
    stack: LocalStack, settings: Settings, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    started = asyncio.Event()

    async def body(c: AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(
            c.batch(
                "tiny",
                [f"Count to {n}:" for n in range(40)],
                output=out,
                options=LONG,
                concurrency=2,
                on_progress=lambda s: s.done and loop.call_soon_threadsafe(started.set),
            )
        )
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(stack, settings, body)
    with Client(stack.redis_url, settings=settings) as sync:
        assert wait_for(lambda: sync.jobs() == [], 60)
    rows = out.read_text().splitlines()
    assert 1 <= len(rows) < 40

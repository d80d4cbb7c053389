"""Jobs that Redis loses or drops on the way, against the real session stack: a waiting
reader finds out (JobLost) instead of waiting out its timeout, and a submission whose
message never reached placement is sent again and runs once."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

import api_client.ajob
import api_client.job
from api_client import Client
from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from api_client.batches.driver import Driver, DriverSettings
from api_client.batches.files import FileStore
from api_client.batches.store import BatchStore
from api_client.job import RESEND_AFTER_S, Job
from api_client.results import result_key
from scheduler.errors import GgufqError, JobLost
from scheduler.protocol import GenerateResponse, JobRequest
from scheduler.store import keys, whereabouts

pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


def claimed_but_never_sent(client: Client, **fields: object) -> Job:
    """A job as a client holds it when Redis went away as placement took its message off
    the queue: its id is claimed, placement never saw it."""
    request = JobRequest.model_validate(
        {
            "model": "tiny",
            "prompt": "Lost on the way",
            # greedy: a sampled token of the tiny model may end it before num_predict
            "options": {"num_predict": 3, "temperature": 0},
            **fields,
        }
    )
    client._claim_id(request)
    return Job(client, request)


def test_a_job_redis_forgot_ends_with_job_lost_not_a_timeout(client: Client) -> None:
    job = claimed_but_never_sent(client)
    client.r.delete(keys.job_submitted(job.id))  # as after a restart without its data
    started = time.monotonic()
    with pytest.raises(JobLost, match=f"job {job.id} is gone: Redis no longer knows it"):
        job.result(timeout=60)
    with pytest.raises(JobLost, match="submit the job again"):
        list(job.stream(timeout=60))
    assert time.monotonic() - started < 30  # found out, not timed out


def test_a_job_waiting_longer_than_its_ids_claim_is_not_lost(client: Client) -> None:
    """Its id's claim and placement claim lapsed as it waited placed (its custody record
    lives on): its reader still knows it, and goes on waiting without sending it again."""
    job = claimed_but_never_sent(client)
    client.r.hset(keys.job_custody(job.id), mapping={"state": "sent", "holder": "p1"})
    client.r.delete(keys.job_submitted(job.id))
    job.submitted_at -= 60  # long past the wait after which a lost submission is resent
    try:
        job.check()  # no JobLost, and not sent to placement again
        assert job._sent_at == 0.0
    finally:
        client.r.delete(keys.job_custody(job.id))


def test_a_job_its_custody_record_places_nowhere_ends_with_job_lost(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded parked, and not in ggufq:parked (a bug, or Redis's data edited by hand):
    nothing would ever move it on. Its readers (its result, its stream, and asyncio's) are
    told so at their second look at it instead of waiting out their timeout."""
    monkeypatch.setattr(whereabouts, "LOOK_EVERY_S", 0.0)  # every check looks
    for module in (api_client.job, api_client.ajob):
        monkeypatch.setattr(module, "CHECK_EVERY_S", 0.1)
    job = claimed_but_never_sent(client)
    client.r.hset(keys.job_custody(job.id), mapping={"state": "parked", "epoch": 3})
    lost = f"job {job.id} is lost: its custody record says parked .epoch 3., but ggufq:parked"
    try:
        with pytest.raises(JobLost, match=lost):
            job.result(timeout=60)
        with pytest.raises(JobLost, match=lost):
            list(Job(client, job.request).stream(timeout=60))

        async def read() -> None:
            async with AsyncClient(client.redis_url, settings=client.settings) as aclient:
                await AsyncJob(aclient, Job(aclient.sync, job.request)).result(timeout=60)

        with pytest.raises(JobLost, match=lost):
            asyncio.run(read())
    finally:
        client.r.delete(keys.job_custody(job.id))


def test_a_batch_line_whose_jobs_claim_lapsed_waits_for_that_job(
    client: Client, tmp_path: Path
) -> None:
    """A cluster batch driver taking over a line whose job waits placed past its id's
    claim: sending the line again is refused (the id is that job's, lua/claim_id.lua), and
    the driver waits for that job instead of failing the line as "already taken"."""
    job = claimed_but_never_sent(client)
    client.r.hset(keys.job_custody(job.id), mapping={"state": "parked", "holder": ""})
    client.r.delete(keys.job_submitted(job.id))  # as once it lapsed
    spec = {"model": "tiny", "prompt": job.request.prompt, "id": job.id, "priority": "batch"}

    async def take_over() -> str:
        async with AsyncClient(client.redis_url, settings=client.settings) as aclient:
            aclient.fast = None  # the normal path, whose claim refuses it
            settings = DriverSettings(concurrency=1, lease_s=30, retention_s=60, max_lines=1)
            files = FileStore(tmp_path, 1 << 20)
            driver = Driver(aclient, BatchStore(aclient.r, 60), files, "b", "h", settings)
            handle = await driver._send_once(spec, repr(job.submitted_at))
            return handle.id

    try:
        assert asyncio.run(take_over()) == job.id
        assert not client.r.exists(keys.job_submitted(job.id))  # nothing claimed anew
        assert client.r.llen(keys.placement_queue("batch")) == 0  # nor sent
    finally:
        client.r.delete(keys.job_custody(job.id))


def test_a_reader_of_a_job_ended_long_ago_gets_job_lost(client: Client) -> None:
    """Its result is kept GGUFQ_RESULT_READ_TTL_S once read, its stream and custody record
    GGUFQ_STREAM_TTL_S after it ended: a reader coming after all of them is told so, both
    ways (sync and asyncio), instead of waiting its whole timeout."""
    job = client.submit("tiny", "The sky is", options={"temperature": 0, "num_predict": 3})
    assert job.result(timeout=60).done
    ttl = client.r.ttl(result_key(client.app, job.id))
    assert 0 < ttl <= client.settings.result_read_ttl_s  # read: kept a while only
    client.r.delete(
        result_key(client.app, job.id), keys.job_chunks(job.id), keys.job_custody(job.id)
    )  # as once they all expired
    # a reader coming after, as a process of its own: the first reader's Celery result
    # consumer may hold the result's message, which came on its channel after its get
    with Client(client.redis_url, settings=client.settings) as later:
        late = Job(later, job.request)
        with pytest.raises(JobLost, match="ended long ago and its result is no longer kept"):
            late.result(timeout=60)

    async def read() -> None:
        async with AsyncClient(client.redis_url, settings=client.settings) as aclient:
            await AsyncJob(aclient, Job(aclient.sync, job.request)).result(timeout=60)

    with pytest.raises(JobLost, match="ended long ago"):
        asyncio.run(read())


def test_a_submission_placement_never_saw_is_sent_again_and_runs_once(client: Client) -> None:
    job = claimed_but_never_sent(client, submitted_at=time.time() - RESEND_AFTER_S)
    result = job.result(timeout=60)
    assert result.done and result.eval_count == 3
    assert client.r.exists(keys.job_placed(job.id))
    # a reader that checks again later sends nothing more: placement has it
    job.check()
    assert client.r.llen(keys.placement_queue()) == 0


def test_a_finished_job_whose_result_was_lost_ends_from_its_stream(client: Client) -> None:
    """Redis restarted from a snapshot taken between a job's final chunk and its result:
    the reader finishes from the stream's final chunk (the whole record) instead of
    waiting out its timeout; a failed job's final chunk raises its error."""
    done = client.submit("tiny", "The sky is", options={"temperature": 0, "num_predict": 3})
    expected = done.result(timeout=60)
    failed = client.submit("tiny", "word " * 5000, options={"num_predict": 3})  # > num_ctx
    with pytest.raises(GgufqError) as raised:
        failed.result(timeout=60)
    client.r.delete(result_key(client.app, done.id), result_key(client.app, failed.id))

    started = time.monotonic()
    again = Job(client, done.request)
    assert again.result(timeout=60) == expected
    with pytest.raises(type(raised.value), match=re.escape(str(raised.value))):
        Job(client, failed.request).result(timeout=60)

    async def from_the_gateway_side() -> GenerateResponse:
        async with AsyncClient(client.redis_url, settings=client.settings) as aio:
            return await AsyncJob(aio, again).result(timeout=60)

    assert asyncio.run(from_the_gateway_side()) == expected
    assert time.monotonic() - started < 30  # found out, not timed out

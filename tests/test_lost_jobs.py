"""Jobs that Redis loses or drops on the way, against the real session stack: a waiting
reader finds out (JobLost) instead of waiting out its timeout, and a submission whose
message never reached placement is sent again and runs once."""

from __future__ import annotations

import time

import pytest

from api_client import Client
from api_client.job import RESEND_AFTER_S, Job
from scheduler.errors import JobLost
from scheduler.protocol import JobRequest
from scheduler.store import keys

pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


def claimed_but_never_sent(client: Client, **fields: object) -> Job:
    """A job as a client holds it when Redis went away as placement took its message off
    the queue: its id is claimed, placement never saw it."""
    request = JobRequest.model_validate(
        {"model": "tiny", "prompt": "Lost on the way", "options": {"num_predict": 3}, **fields}
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


def test_a_submission_placement_never_saw_is_sent_again_and_runs_once(client: Client) -> None:
    job = claimed_but_never_sent(client, submitted_at=time.time() - RESEND_AFTER_S)
    result = job.result(timeout=60)
    assert result.done and result.eval_count == 3
    assert client.r.exists(keys.job_placed(job.id))
    # a reader that checks again later sends nothing more: placement has it
    job.check()
    assert client.r.llen(keys.placement_queue()) == 0

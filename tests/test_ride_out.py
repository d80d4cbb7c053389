"""A streaming reader rides out Redis going away (api_client/job.py ``Job._chunks``): it
reads again after the last chunk it saw once Redis answers, each outage given the reader's
lease, and raises Redis's error when Redis stays away longer. The stream's reading is a
recording fake here; Redis (answering, or not) is the session's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import api_client.job as job_module
from api_client import Client
from api_client.job import Job


class Blips:
    """read_chunks as a Redis that goes away twice mid-stream, the second time after a
    quiet spell longer than the reader's lease."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self.asked: list[int] = []

    def __call__(
        self, _r: Any, _job_id: str, _wait: Any, after: int, *_rest: Any
    ) -> Iterator[dict[str, Any]]:
        self.asked.append(after)
        if after == 0:
            yield {"seq": 1, "response": "a"}
            raise redis.ConnectionError("Connection closed by server.")
        if after == 1:
            yield {"seq": 2, "response": "b"}
            time.sleep(self.quiet_s)  # a quiet job: no chunk for longer than the lease
            raise redis.ConnectionError("Connection closed by server.")
        yield {"seq": 3, "response": "", "done": True}


def test_a_reader_reads_on_after_each_outage_from_its_last_chunk(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client.settings, "reader_lease_s", 0.5)
    blips = Blips(quiet_s=0.6)
    monkeypatch.setattr(job_module, "read_chunks", blips)
    job = Job(client, client.request("tiny", "x"))
    seen = [chunk["seq"] for chunk in job._chunks(5.0, 0)]
    assert seen == [1, 2, 3]  # none twice, none lost
    assert blips.asked == [0, 1, 2]  # each time from the last chunk seen


def test_a_redis_away_longer_than_the_lease_raises_its_error(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client.settings, "reader_lease_s", 0.3)
    monkeypatch.setattr(job_module, "read_chunks", Blips(quiet_s=0))

    def away() -> bool:
        raise redis.ConnectionError("Error 111 connecting: Connection refused")

    monkeypatch.setattr(client.r, "ping", away)
    job = Job(client, client.request("tiny", "x"))
    chunks = job._chunks(5.0, 0)
    assert next(chunks)["seq"] == 1
    with pytest.raises(redis.ConnectionError, match="Connection closed by server"):
        next(chunks)

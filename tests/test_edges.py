"""Bad input and a Redis that does not answer, from Python: typed errors that name the
problem and the fix, never redis-py's bare ConnectionError or a silent nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from api_client import AsyncClient, Client
from scheduler.errors import InvalidRequest, RedisUnavailable, shown
from scheduler.local.embedded import free_port
from scheduler.protocol import JobRequest, check_model_name, parse_request
from scheduler.settings import Settings


def test_a_client_of_a_redis_that_does_not_answer_raises_a_typed_error(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = Settings(redis_url=url, state_dir=tmp_path, models_dir=tmp_path)
    with Client(settings=settings) as client, pytest.raises(RedisUnavailable) as refused:
        client.ps()
    assert "cannot reach Redis at 127.0.0.1:" in str(refused.value)
    assert "`ggufq up`" in str(refused.value) and "GGUFQ_REDIS_URL" in str(refused.value)
    # what waits for Redis still takes it for a lost connection, as before
    assert isinstance(refused.value, redis.ConnectionError)

    async def listed() -> None:
        async with AsyncClient(settings=settings) as aclient:
            await aclient.ps()

    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        asyncio.run(listed())


def test_bad_ids_names_and_pins_are_refused(client: Client) -> None:
    with pytest.raises(InvalidRequest, match="'' is not a job id"):
        client.cancel("")
    with pytest.raises(InvalidRequest, match=r"100,002 chars\) is not a job id"):
        client.cancel("x" * 100_000)
    with pytest.raises(InvalidRequest, match="holds a control character"):
        client.submit("tiny\n", "hi")
    with pytest.raises(InvalidRequest, match="device"):
        client.submit("tiny", "hi", device="")
    with pytest.raises(InvalidRequest, match="names cannot hold"):
        check_model_name("tiny\t")


def test_an_invalid_field_is_named_without_echoing_it_whole() -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request({"model": "tiny", "prompt": "x" * 5_000_000})
    message = str(refused.value)
    assert "prompt" in message and len(message) < 400
    assert shown("short") == "'short'"
    assert shown(list(range(1000))).endswith("(1,000 items)")
    assert JobRequest(model="tiny", device="cpu:h").device == "cpu:h"

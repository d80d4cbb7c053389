"""Bad input and a Redis that does not answer, from Python: typed errors that name the
problem and the fix, never redis-py's bare ConnectionError or a silent nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from api_client import AsyncClient, Client
from scheduler.errors import GgufqError, InvalidRequest, RedisUnavailable, ServerBusy, shown
from scheduler.local.embedded import free_port
from scheduler.names import check_model_name
from scheduler.protocol import JobRequest, parse_request
from scheduler.settings import Settings
from scheduler.store import keys
from tests.conftest import ggufq
from tests.tinymodel import write_tiny_model


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


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("redis+cluster://u:hunter2@h:7000/0", "Redis Cluster is not supported"),
        ("rediss+cluster://h:7000", "Redis Cluster is not supported"),
        ("sentinel://h:26379;sentinel://g:26379", "give Sentinel as redis+sentinel://"),
        ("redis+sentinel://h:26379/0", "add ?master=NAME"),
        ("http://h:6379", "http: give redis://"),
        ("h:6379", "no scheme: give redis://"),
    ],
)
def test_a_redis_url_ggufq_cannot_use_is_refused_by_the_command_line(
    url: str, said: str, tmp_path: Path
) -> None:
    out = ggufq("ps", env={"GGUFQ_REDIS_URL": url, "GGUFQ_STATE_DIR": str(tmp_path)})
    assert out.returncode != 0
    assert said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "hunter2" not in out.stderr  # the password is masked
    for ok in ("redis://h:1/0", "rediss://h:1", "unix:///tmp/redis.sock"):
        assert Settings(redis_url=ok).redis_url == ok  # Valkey too: the same URLs


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


def test_a_schema_whose_grammar_could_not_be_built_is_refused() -> None:
    def job(schema: dict[str, object]) -> JobRequest:
        return parse_request({"model": "tiny", "prompt": "x", "format": schema})

    huge = {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000}
    with pytest.raises(InvalidRequest, match=r"format.minItems is 100,000,000; .* at most 1,024"):
        job(huge)
    with pytest.raises(InvalidRequest, match=r"format.properties.a.pattern's \{5000\}"):
        job({"type": "object", "properties": {"a": {"type": "string", "pattern": "x{5000}"}}})
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest, match="nests deeper than 32"):
        job(deep)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}
    with pytest.raises(InvalidRequest, match="at most 65,536 are taken"):
        job(wide)
    fine = {"type": "array", "items": {"type": "integer"}, "maxItems": 1024}
    assert job(fine).format == fine


def test_a_jobs_text_and_stop_strings_are_bounded() -> None:
    two = [{"role": "user", "content": "x" * 3_000_000}] * 2
    with pytest.raises(InvalidRequest, match=r"6,000,000 characters .* at most 4,000,000"):
        parse_request({"model": "tiny", "kind": "chat", "messages": two})
    with pytest.raises(InvalidRequest, match="input"):
        parse_request({"model": "tiny", "kind": "embed", "input": ["x" * 1_000_000] * 5})
    with pytest.raises(InvalidRequest, match=r"options.stop.0: String should have at most 1000"):
        parse_request({"model": "tiny", "prompt": "x", "options": {"stop": ["s" * 1001]}})


def test_a_flood_of_maximal_jobs_leaves_room_for_normal_ones(
    client: Client, r: redis.Redis
) -> None:
    """Redis with 64 MiB to spare (maxmemory, noeviction): jobs of the largest text are let
    in while there is room for them, and refused with ServerBusy past that, while small
    jobs go on being served; every job admitted ends with an outcome."""
    before = r.config_get("maxmemory")["maxmemory"]
    for counted in r.scan_iter(f"{keys.MEMORY_ADMITTED}:*"):  # another test's, lately
        r.delete(counted)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", used + (64 << 20))
    admitted, refused = [], []
    try:
        for _ in range(10):  # as fast as they come: none has ended as the next arrives
            try:
                admitted.append(client.submit("tiny", "x " * 2_000_000, options={"num_predict": 1}))
            except ServerBusy as exc:
                refused.append(str(exc))
        for _ in range(3):
            small = client.generate("tiny", "hello", options={"num_predict": 2, "temperature": 0})
            assert small.done
        outcomes = []
        for job in admitted:
            try:
                outcomes.append(job.result(timeout=120).done_reason)
            except GgufqError as exc:  # typed: too long for the tiny model's context
                outcomes.append(exc.code)
    finally:
        r.config_set("maxmemory", before)
    assert admitted and refused, (len(admitted), refused)
    assert all("left of its maxmemory" in reason for reason in refused)
    assert len(outcomes) == len(admitted), outcomes


def test_a_chat_template_that_never_ends_fails_its_job_not_the_worker(
    client: Client, models_dir: Path
) -> None:
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    path = write_tiny_model(models_dir / "loops.gguf", chat_template=endless)
    try:
        with pytest.raises(InvalidRequest, match="chat template of model 'loops' did not finish"):
            client.chat("loops", [{"role": "user", "content": "hi"}], options={"num_predict": 2})
        assert client.generate("tiny", "hello", options={"num_predict": 2}).done  # serves on
    finally:
        path.unlink()

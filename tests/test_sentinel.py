"""Redis behind Sentinel (issue 38): ggufq's clients find the primary through its sentinels,
and follow a failover by themselves. A primary, a replica and three sentinels run on
loopback (tests/sentinels.py); the primary is SIGKILLed, the sentinels promote the replica,
and the same clients and the same stack serve again without a restart."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from pathlib import Path

import httpx
import openai
import pytest
import redis

from api_client import Client
from scheduler.errors import RedisUnavailable
from scheduler.local.embedded import free_port
from scheduler.local.stack import LocalStack
from scheduler.redis_urls import masked
from scheduler.settings import Settings
from scheduler.store.connection import connect, connect_typed, connect_typed_async
from scheduler.store.sentinel import parse
from tests.conftest import settings_from, stack_env, wait_for
from tests.gateway_server import running_gateway
from tests.held_worker import HOLD, is_held, release
from tests.sentinels import Group, sentinel_group, tls_server
from tests.test_batch_api import ENDED, jsonl, line, rows

SHORT = {"temperature": 0, "num_predict": 4}
HELD = "tests.held_worker"


@pytest.fixture()
def group(tmp_path: Path) -> Group:  # type: ignore[misc]
    with sentinel_group(tmp_path / "redis") as found:
        yield found


def test_a_sentinel_url_names_its_sentinels_primary_and_credentials() -> None:
    found = parse("redis+sentinel://worker:p%40ss@h1:26379,h2:26380/2?master=main")
    assert found.sentinels == (("h1", 26379), ("h2", 26380)) and found.master == "main"
    assert (found.db, found.username, found.password) == (2, "worker", "p@ss")
    assert found.kombu_url == (
        "sentinel://worker:p%40ss@h1:26379/2;sentinel://worker:p%40ss@h2:26380/2"
    )
    options = found.transport_options({"socket_timeout": 5})
    assert options == {
        "master_name": "main",
        "sentinel_kwargs": {"socket_timeout": 5, "password": None},
    }
    with pytest.raises(ValueError, match="master=NAME"):
        Settings(redis_url="redis+sentinel://h1:26379/0")
    with pytest.raises(ValueError, match="HOST or HOST:PORT"):
        Settings(redis_url="redis+sentinel://h1:port/0?master=m")
    # a port left out is Sentinel's; an IPv6 sentinel keeps its brackets in kombu's form
    v6 = parse("REDIS+SENTINEL://[::1],h2/0?master=m".lower())
    assert v6.sentinels == (("::1", 26379), ("h2", 26379))
    assert v6.kombu_url == "sentinel://[::1]:26379/0;sentinel://h2:26379/0"
    assert Settings(redis_url="REDIS://h:1/0").redis_url == "redis://h:1/0"  # as redis-py reads
    # over TLS: a rediss:// URL's options, to the sentinels and the primary alike
    tls = parse("rediss+sentinel://h1/0?master=m&ssl_ca_certs=/ca.pem&ssl_cert_reqs=none")
    assert tls.tls_options == {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": ssl.CERT_NONE}
    assert tls.kombu_url == "sentinel://h1:26379/0" and found.tls_options == {}
    assert parse("rediss+sentinel://h1/0?master=m").tls_options == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED  # checked by default, as rediss://
    }
    unnamed = parse("rediss+sentinel://h1/0?master=m&ssl_check_hostname=false")
    assert unnamed.tls_options["ssl_check_hostname"] is False
    with pytest.raises(ValueError, match="give the URL as rediss"):  # not TLS in silence
        Settings(redis_url="redis+sentinel://h1/0?master=m&ssl_ca_certs=/ca.pem")
    # `ggufq config` and every message show it without either password
    shown = masked("redis+sentinel://w:p1@h1:1,h2:2/0?sentinel_password=p2&master=m")
    assert shown == "redis+sentinel://w:****@h1:1,h2:2/0?sentinel_password=****&master=m"


def answers(client: redis.Redis, value: str) -> bool:
    try:
        client.set("ggufq:test:sentinel", value)
        return client.get("ggufq:test:sentinel") == value.encode()
    except redis.RedisError:
        return False


def test_clients_follow_a_failover(group: Group) -> None:
    sync = connect(group.url)
    assert answers(sync, "before")
    group.kill_primary()
    assert wait_for(lambda: group.primary_port() == group.replica, timeout=60)
    assert wait_for(lambda: answers(sync, "after"), timeout=30)

    async def async_side() -> bool:
        aclient = connect_typed_async(group.url)
        try:
            await aclient.set("ggufq:test:sentinel", "async")
            return await aclient.get("ggufq:test:sentinel") == b"async"
        finally:
            await aclient.aclose()

    assert asyncio.run(async_side())
    sync.close()


def test_no_sentinel_answering_is_a_typed_error_that_says_so() -> None:
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/0?master=gone"
    client = connect_typed(url)
    with pytest.raises(RedisUnavailable, match="the primary 'gone' its sentinels name"):
        client.ping()
    client.close()


def test_a_bounded_pool_behind_sentinel_keeps_its_bound(group: Group) -> None:
    """The gateway's client holds a few connections whatever the number of its waiting
    requests: behind Sentinel too, a command waits for a free one."""

    async def many() -> int:
        bounded = connect_typed_async(group.url, max_connections=2)
        try:
            await asyncio.gather(*(bounded.incr("ggufq:test:bounded") for _ in range(50)))
            assert await bounded.get("ggufq:test:bounded") == b"50"
            pool = bounded.connection_pool
            return len(pool._available_connections) + len(pool._in_use_connections)  # type: ignore[attr-defined]
        finally:
            await bounded.aclose()

    assert 1 <= asyncio.run(many()) <= 2
    sync = connect_typed(group.url, max_connections=2)
    assert [sync.incr("ggufq:test:bounded") for _ in range(3)] == [51, 52, 53]
    sync.close()


def test_a_dead_sentinel_is_passed_over(group: Group) -> None:
    group.procs["sentinel-0"].kill()  # the first one the URL names
    client = connect_typed(group.url)
    assert answers(client, "still")
    client.close()


def serves(client: Client) -> bool:
    """Whether the stack answers a short job now (after a failover: once it serves again)."""
    try:
        return client.generate("tiny", "after", options=SHORT).done
    except Exception:
        return False


def test_a_stack_on_sentinel_serves_again_after_its_primary_dies(
    group: Group, models_dir: Path, tmp_path: Path
) -> None:
    env = {**stack_env(models_dir, tmp_path / "state", host="sentinelhost")}
    settings = settings_from(env, group.url)
    env["GGUFQ_REDIS_URL"] = group.url  # the children's
    with LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env) as stack:
        with Client(group.url, settings=settings, timeout=60) as client:
            assert client.generate("tiny", "before", options=SHORT).done
            group.kill_primary()
            assert wait_for(lambda: group.primary_port() == group.replica, timeout=60)

            assert wait_for(lambda: serves(client), timeout=90), f"see {stack.log_dir}"


def needs_tls_server() -> None:
    """Skip (fail under CI) where no redis-server on PATH has TLS."""
    if tls_server() is None:
        if os.environ.get("CI"):
            pytest.fail("no redis-server with TLS on PATH (CI's image has redis-server 7)")
        pytest.skip("needs a redis-server with TLS on PATH: apt-get install redis-server")


@pytest.fixture()
def tls_group(tmp_path: Path) -> Group:  # type: ignore[misc]
    needs_tls_server()
    with sentinel_group(tmp_path / "redis", tls=True) as found:
        yield found


def test_a_stack_behind_sentinel_over_tls_serves_and_follows_a_failover(
    tls_group: Group, models_dir: Path, tmp_path: Path
) -> None:
    """rediss+sentinel://: the sentinels and the primary speak TLS only; every process of
    the stack (Celery's broker and results, redis-py's clients) finds the primary through
    them, and after its death the promoted replica, with no restart."""
    url = tls_group.url
    assert url.startswith("rediss+sentinel://") and parse(url).tls_options

    async def answers_async() -> bool:  # the gateway's kind of client, bounded
        client = connect_typed_async(url, max_connections=2)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    sync = connect_typed(url, max_connections=2)
    assert asyncio.run(answers_async()) and answers(sync, "tls")
    sync.close()
    env = {**stack_env(models_dir, tmp_path / "state", host="tlshost")}
    settings = settings_from(env, url)
    env["GGUFQ_REDIS_URL"] = url  # the children's
    with LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env) as stack:
        with Client(url, settings=settings, timeout=60) as client:
            assert client.generate("tiny", "before", options=SHORT).done
            tls_group.kill_primary()
            assert wait_for(lambda: tls_group.primary_port() == tls_group.replica, timeout=60)
            assert wait_for(lambda: serves(client), timeout=90), f"see {stack.log_dir}"
    with pytest.raises(ValueError, match="required, optional or none"):
        Settings(redis_url=url + "&ssl_cert_reqs=maybe")


def test_a_stream_rides_out_a_failover_mid_answer(
    group: Group, models_dir: Path, tmp_path: Path
) -> None:
    """The primary dies while a job streams (held running after its first text: the
    event this test controls); the sentinels promote the replica; the job goes on, and
    its reader, reading again from its last chunk, gets the whole answer, once."""
    env = {**stack_env(models_dir, tmp_path / "state", host="failoverhost")}
    settings = settings_from(env, group.url).model_copy(update={"reader_lease_s": 15.0})
    env["GGUFQ_REDIS_URL"] = group.url
    held = "tests.held_worker"
    body = {"model": "tiny", "prompt": f"{HOLD} far away", "options": {**SHORT, "num_predict": 12}}
    with (
        LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env, worker_module=held),
        running_gateway(settings) as url,
        httpx.Client(timeout=60) as http,
        Client(group.url, settings=settings, timeout=60) as client,
        http.stream("POST", f"{url}/api/generate", json=body) as answer,
    ):
        lines = answer.iter_lines()
        over_http = [json.loads(next(lines))]  # its first text: held running too
        job = client.submit("tiny", f"{HOLD} once upon", options={**SHORT, "num_predict": 12})
        chunks = iter(job.stream())
        first = next(chunks)  # its first text: the job is held running
        group.kill_primary()
        assert wait_for(lambda: group.primary_port() == group.replica, timeout=60)
        on_new = connect(group.url)

        def released() -> bool:  # as soon as the sentinels agree on the new primary
            try:
                release(on_new, job.id)
                release(on_new, answer.headers["x-ggufq-job"])
                return True
            except redis.RedisError:
                return False

        assert wait_for(released, timeout=30)
        rest = list(chunks)
        over_http += [json.loads(line) for line in lines if line]
        on_new.close()
    seqs = [c.seq for c in [first, *rest] if c.seq is not None]
    assert seqs == sorted(set(seqs)), seqs  # none twice
    assert rest[-1].done and rest[-1].done_reason in ("length", "stop")
    streamed = "".join(c.response for c in [first, *rest[:-1]])
    assert streamed and streamed == rest[-1].response  # the whole answer, nothing twice
    # the gateway's stream rode it out too: no error line, and its end
    assert not [line for line in over_http if "error" in line], over_http
    assert over_http[-1]["done"] and over_http[-1]["done_reason"] in ("length", "stop")


def test_a_batch_finishes_through_a_failover_of_its_primary(
    group: Group, models_dir: Path, tmp_path: Path
) -> None:
    """The primary dies while a server-side batch runs (two of its lines held running:
    the event this test controls); the sentinels promote the replica; the batch's driver
    goes on on the new primary, and every line ends in a defined outcome, each once."""
    env = {**stack_env(models_dir, tmp_path / "state", host="batchfailover")}
    settings = settings_from(env, group.url).model_copy(update={"reader_lease_s": 15.0})
    env["GGUFQ_REDIS_URL"] = group.url
    requests = [line(f"q{i}", f"quick {i}") for i in range(3)]
    requests += [line(f"h{i}", f"{HOLD} {i}") for i in range(2)]
    with (
        LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env, worker_module=HELD),
        running_gateway(settings) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
    ):
        upload = api.files.create(file=("f.jsonl", jsonl(*requests)), purpose="batch")
        batch = api.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        held_jobs = [f"{batch.id}-{i}" for i in (3, 4)]
        before = connect(group.url)
        assert wait_for(lambda: any(is_held(before, j) for j in held_jobs), timeout=60)
        before.close()
        group.kill_primary()
        assert wait_for(lambda: group.primary_port() == group.replica, timeout=60)
        on_new = connect(group.url)

        def released() -> bool:  # as soon as the sentinels agree on the new primary
            try:
                for job_id in held_jobs:
                    release(on_new, job_id)
                return True
            except redis.RedisError:
                return False

        def status() -> str:
            try:
                return str(api.batches.retrieve(batch.id).status)
            except openai.APIError:  # the gateway meets the failover too: asked again
                return ""

        assert wait_for(released, timeout=30)
        assert wait_for(lambda: status() in ENDED, timeout=120)
        done = api.batches.retrieve(batch.id)
        answered = rows(api, done.output_file_id) + rows(api, done.error_file_id)
        on_new.close()
    assert done.status == "completed", done
    custom_ids = sorted(a["custom_id"] for a in answered)
    assert custom_ids == sorted([*(f"q{i}" for i in range(3)), "h0", "h1"])  # each once
    assert all(a["response"] or a["error"] for a in answered)

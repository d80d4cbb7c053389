"""The gateway over raw HTTP: SSE framing, keep-alive bytes while a job waits, a client that
disconnects cancels its job, API keys and their limits, and the metrics."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import redis
from anthropic.types import MessageParam

from api_client import Client, JobCancelled
from api_client.gateway import make_app
from api_client.gateway.core import Gateway
from api_client.gateway.errors import RateLimited
from api_client.gateway.keys import KeyStore, Limiter
from api_client.job import Job
from scheduler.local.stack import LocalStack
from scheduler.protocol import JobRequest
from scheduler.store import keys
from tests.conftest import ggufq, stack_env, wait_for
from tests.gateway_server import running_gateway, serving
from tests.tinymodel import write_slow_model

ENDLESS = {"temperature": 0, "num_predict": 100_000}  # the slow model never stops by itself


@pytest.fixture(scope="module")
def slow(models_dir: Path) -> Iterator[str]:
    """A model whose jobs run until cancelled (put beside the session's models, then gone)."""
    path = write_slow_model(models_dir / "gw-slow.gguf")
    yield "gw-slow"
    path.unlink()


@pytest.fixture(scope="module")
def url(stack: LocalStack, slow: str) -> Iterator[str]:
    # keep-alive bytes between the worker's chunk writes (every 0.1 s)
    settings = stack.settings.model_copy(update={"http_keepalive_s": 0.02})
    with running_gateway(settings) as base:
        yield base


@pytest.fixture(scope="module")
def keyed(stack: LocalStack, slow: str) -> Iterator[str]:
    with running_gateway(stack.settings, require_keys=True) as base:
        yield base


def test_sse_framing(url: str) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the sky is"}],
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-2] if e.startswith("data: ")]
    assert all(d["object"] == "chat.completion.chunk" for d in data)
    assert data[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    comments = [e for e in events if e.startswith(":")]
    assert set(comments) <= {": keep-alive"}


def test_a_stream_says_what_the_gateway_and_the_cluster_took_before_its_first_byte(
    url: str,
) -> None:
    body = {"model": "tiny", "prompt": "the sky is", "raw": True, "options": {"num_predict": 4}}
    started = time.time()
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60) as response:
        head_at = time.time()
        header = response.headers["server-timing"]
        assert json.loads(list(response.iter_lines())[-1])["done"]
    parts = {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([0-9.]+)", header)}
    assert set(parts) == {"gateway", "cluster"}, header  # both there, neither negative
    assert 0 < parts["gateway"] < parts["gateway"] + parts["cluster"]
    assert parts["gateway"] + parts["cluster"] <= (head_at - started) * 1000


def test_keepalive_records_between_chunks_parse_as_empty(url: str, slow: str) -> None:
    body = {"model": slow, "prompt": "x", "raw": True, "options": {"num_predict": 400}}
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60) as response:
        records = [json.loads(line) for line in response.iter_lines()]
    empty = [r for r in records if not r["done"] and r["response"] == ""]
    assert empty, "no keep-alive record between chunks sent 0.1 s apart"
    assert records[-1]["done"] and records[-1]["eval_count"] == 400


def test_client_that_disconnects_cancels_its_job(url: str, client: Client, slow: str) -> None:
    body = {"model": slow, "prompt": "x", "raw": True, "options": ENDLESS}
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60) as response:
        job_id = response.headers["x-ggufq-job"]
        first = next(response.iter_lines())
        assert json.loads(first)["done"] is False
    job = Job(client, JobRequest(id=job_id, model=slow))
    with pytest.raises(JobCancelled):
        job.result(timeout=60)


def test_keys_are_required_when_asked_for(keyed: str, r: redis.Redis) -> None:
    tiny_only, token = KeyStore(r).create("tests", models=["tiny"])
    bare = httpx.post(f"{keyed}/api/generate", json={"model": "tiny", "prompt": "hi"})
    assert bare.status_code == 401 and "ggufq keys create" in bare.json()["error"]
    assert httpx.get(keyed).status_code == 200  # "Ollama is running" needs no key
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0) as api:
        with pytest.raises(openai.AuthenticationError):
            api.models.list()
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key=token, max_retries=0) as api:
        answer = api.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert answer.choices[0].text is not None
        with pytest.raises(openai.PermissionDeniedError, match="may not use"):
            api.completions.create(model="gw-slow", prompt="hi", max_tokens=4)
    messages: list[MessageParam] = [{"role": "user", "content": "hi"}]
    with anthropic.Anthropic(base_url=keyed, api_key=token, max_retries=0) as claude:
        assert claude.messages.create(model="tiny", max_tokens=4, messages=messages).content
    with anthropic.Anthropic(base_url=keyed, api_key="wrong", max_retries=0) as claude:
        with pytest.raises(anthropic.AuthenticationError, match="x-api-key"):
            claude.messages.create(model="tiny", max_tokens=4, messages=messages)
    KeyStore(r).revoke(tiny_only.id)
    gone = httpx.get(f"{keyed}/api/tags", headers={"Authorization": f"Bearer {token}"})
    assert gone.status_code == 401


def test_keys_made_by_an_older_ggufq_are_migrated_by_the_administrator(
    keyed: str, r: redis.Redis, stack: LocalStack, models_dir: Path, session_dir: Path
) -> None:
    """Before the API keys had a keyspace of their own (which only the gateway's Redis user
    may touch), they lived under ggufq:apikey*, which every role may write: `ggufq keys
    migrate` copies them, once, and never overwrites a key that is already there."""
    key, token = KeyStore(r).create("from-before")
    digest = r.hget(keys.API_KEYS, key.id)
    assert digest is not None
    r.rename(keys.api_key(digest.decode()), keys.old_api_key(digest.decode()))
    r.hdel(keys.API_KEYS, key.id)
    r.hset(keys.OLD_API_KEYS, key.id, digest)
    kept, _ = KeyStore(r).create("kept")  # an old record naming its id does not replace it
    r.hset(keys.OLD_API_KEYS, kept.id, "junk")
    r.set(keys.old_api_key("junk"), "{}")
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{keyed}/api/tags", headers=headers).status_code == 401  # not yet
    env = dict(stack_env(models_dir, session_dir / "state"), GGUFQ_REDIS_URL=stack.redis_url)
    out = ggufq("keys", "migrate", env=env)
    assert out.returncode == 0 and "copied 1 key " in out.stdout, out.stdout + out.stderr
    assert r.hget(keys.API_KEYS, kept.id) != b"junk"
    assert r.exists(keys.old_api_key(digest.decode()))  # for gateways not yet upgraded
    assert httpx.get(f"{keyed}/api/tags", headers=headers).status_code == 200
    assert ggufq("keys", "migrate", "--remove-old", env=env).returncode == 0
    assert not r.exists(keys.OLD_API_KEYS, keys.old_api_key(digest.decode()))
    for made in (key, kept):
        KeyStore(r).revoke(made.id)


def test_a_keys_scope_listings_ceilings_and_admin(keyed: str, r: redis.Redis, slow: str) -> None:
    """A key sees only its models in every listing; only an admin key unloads or pins a
    model, or asks for more context than its ceiling; no answer names a file path."""
    _key, token = KeyStore(r).create("scoped", models=["tiny"])
    _admin, admin_token = KeyStore(r).create("ops", admin=True)
    with ollama.Client(host=keyed, headers={"Authorization": f"Bearer {token}"}) as api:
        assert [m.model for m in api.list().models] == ["tiny"]
        assert {m.model for m in api.ps().models} <= {"tiny"}
        for refused_call, reason in (
            (lambda: api.generate(model="tiny", prompt="", keep_alive=0), "may not unload"),
            (lambda: api.generate(model="tiny", prompt="hi", keep_alive=-1), "for ever"),
            (lambda: api.generate(model="tiny", prompt="hi", keep_alive="2h"), "3600 s"),
            (
                lambda: api.generate(model="tiny", prompt="hi", options={"num_ctx": 65536}),
                "at most 32,768",
            ),
        ):
            with pytest.raises(ollama.ResponseError) as refused:
                refused_call()
            assert refused.value.status_code == 403 and reason in refused.value.error
        with pytest.raises(ollama.ResponseError) as missing:
            api.show("nosuchmodel")
        assert "/" not in missing.value.error.replace("GET /api/tags", "")
        assert "FROM tiny.gguf" in (api.show("tiny").modelfile or "")
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key=token, max_retries=0) as api:
        assert [m.id for m in api.models.list()] == ["tiny"]
        with pytest.raises(openai.NotFoundError):
            api.models.retrieve(slow)
    _short, short_token = KeyStore(r).create("short", max_keep_alive_s=600)
    with ollama.Client(host=keyed, headers={"Authorization": f"Bearer {short_token}"}) as api:
        with pytest.raises(ollama.ResponseError) as too_long:
            api.generate(model="tiny", prompt="hi", keep_alive="20m")
        assert too_long.value.status_code == 403 and "600 s" in too_long.value.error
        assert api.generate(
            model="tiny", prompt="hi", keep_alive="5m", options={"num_predict": 1}
        ).done
    with ollama.Client(host=keyed, headers={"Authorization": f"Bearer {admin_token}"}) as api:
        assert slow in [m.model for m in api.list().models]
        assert api.generate(model="tiny", prompt="", keep_alive=0).done_reason == "unload"


def test_requests_per_minute_and_in_flight(keyed: str, r: redis.Redis, slow: str) -> None:
    _key, token = KeyStore(r).create("rpm", rpm=2)
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key=token, max_retries=0) as api:
        api.models.list()
        api.models.list()
        with pytest.raises(openai.RateLimitError) as limited:
            api.models.list()
    assert int(limited.value.response.headers["retry-after"]) >= 1
    _key, token = KeyStore(r).create("one at a time", max_in_flight=1)
    auth = {"Authorization": f"Bearer {token}"}
    body = {"model": slow, "prompt": "x", "raw": True, "options": ENDLESS}
    with httpx.stream("POST", f"{keyed}/api/generate", json=body, headers=auth) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        second = httpx.get(f"{keyed}/api/tags", headers=auth)
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert httpx.get(f"{keyed}/api/tags", headers=auth).status_code == 200


def test_with_a_secret_a_key_written_straight_into_redis_is_no_key(
    stack: LocalStack, r: redis.Redis
) -> None:
    """Whoever holds Redis's password can write a key record for a token of their own; a
    gateway with GGUFQ_HTTP_KEY_SECRET takes only records signed with that secret."""
    settings = stack.settings.model_copy(update={"http_key_secret": "s3cret-of-the-gateways"})
    _signed, token = KeyStore(r, settings.http_key_secret).create("signed")
    forged = "ggufq-forged-0000"
    digest = hashlib.sha256(forged.encode()).hexdigest()
    r.set(keys.api_key(digest), json.dumps({"id": "forged", "models": [], "admin": True}))
    with running_gateway(settings, require_keys=True) as base:
        good = httpx.get(f"{base}/api/tags", headers={"Authorization": f"Bearer {token}"})
        bad = httpx.get(f"{base}/api/tags", headers={"Authorization": f"Bearer {forged}"})
    assert good.status_code == 200 and bad.status_code == 401
    assert KeyStore(r).lookup(token).name == "signed"  # a store without it reads it still
    config = ggufq("config", env={"GGUFQ_HTTP_KEY_SECRET": "s3cret-of-the-gateways"})
    assert "s3cret" not in config.stdout and "GGUFQ_HTTP_KEY_SECRET" in config.stdout


def test_a_dead_gateways_requests_stop_counting_against_their_key(r: redis.Redis) -> None:
    key, _token = KeyStore(r).create("two gateways", max_in_flight=1)
    first, second = Limiter(r, "gw-first"), Limiter(r, "gw-second")
    first.beat()
    second.beat()
    assert first.admit(key, time.time()) is not None  # a request in flight on the first
    with pytest.raises(RateLimited):
        second.admit(key, time.time())  # the first is alive: its request counts
    r.delete(keys.gateway_beat("gw-first"))  # it was killed: its beat lapses
    ticket = second.admit(key, time.time())
    assert ticket is not None and ticket.startswith("gw-second:")
    second.done(key, ticket)


def test_a_keys_id_is_the_tenant_of_its_jobs_and_its_weight_their_share(
    stack: LocalStack, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, token = KeyStore(r).create("tenant", weight=3)
    app = make_app(stack.settings, require_keys=True)
    gateway: Gateway = app.state.gateway
    made: list[JobRequest] = []
    sync = gateway.client.sync
    request = sync.request

    def spy(*args: Any, **kwargs: Any) -> JobRequest:  # the job either path then sends
        made.append(request(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sync, "request", spy)
    auth = {"Authorization": f"Bearer {token}"}
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    with serving(app) as base:
        answer = httpx.post(f"{base}/api/generate", json=body, headers=auth, timeout=60)
    assert answer.status_code == 200 and answer.json()["done"]
    assert [(job.tenant, job.weight) for job in made] == [(key.id, 3.0)]


def test_metrics_count_requests_by_route_and_status(url: str) -> None:
    httpx.post(f"{url}/api/show", json={"model": "nosuchmodel"})
    text = httpx.get(f"{url}/metrics").text
    assert 'ggufq_gateway_requests_total{key="",route="/api/show",status="404"}' in text
    assert "ggufq_gateway_time_to_first_byte_seconds_bucket" in text


def test_keys_command_line(stack: LocalStack, models_dir: Path, session_dir: Path) -> None:
    env = {**stack_env(models_dir, session_dir / "state"), "GGUFQ_REDIS_URL": stack.redis_url}
    made = ggufq("keys", "create", "--name", "cli", "--model", "tiny", "--rpm", "5", env=env)
    assert made.returncode == 0, made.stderr
    key_id = made.stdout.split()[2].rstrip(";")
    assert made.stdout.splitlines()[1].startswith("ggufq-")
    listed = ggufq("keys", "list", "--json", env=env)
    assert {"id": key_id, "models": ["tiny"], "rpm": 5}.items() <= next(
        k for k in json.loads(listed.stdout) if k["id"] == key_id
    ).items()
    assert ggufq("keys", "revoke", key_id, env=env).returncode == 0
    assert ggufq("keys", "revoke", key_id, env=env).returncode == 1


def test_a_key_lists_and_cancels_its_own_jobs_by_id(keyed: str, r: redis.Redis, slow: str) -> None:
    """``GET /api/jobs`` lists a key's jobs not ended yet and ``DELETE /api/jobs/{id}``
    cancels one, wherever it is; another key sees neither and cannot cancel it (404)."""
    owner, token = KeyStore(r).create("owner")
    other, other_token = KeyStore(r).create("other")
    auth, other_auth = ({"Authorization": f"Bearer {t}"} for t in (token, other_token))
    body = {"model": slow, "prompt": "x", "raw": True, "options": ENDLESS}
    with httpx.stream("POST", f"{keyed}/api/generate", json=body, headers=auth) as held:
        job_id = held.headers["x-ggufq-job"]
        lines = held.iter_lines()
        assert json.loads(next(lines))["done"] is False  # it runs
        listed = httpx.get(f"{keyed}/api/jobs", headers=auth).json()["jobs"]
        assert [(j["id"], j["tenant"], j["state"]) for j in listed] == [
            (job_id, owner.id, "running")
        ]
        assert httpx.get(f"{keyed}/api/jobs", headers=other_auth).json() == {"jobs": []}
        refused = httpx.delete(f"{keyed}/api/jobs/{job_id}", headers=other_auth)
        assert refused.status_code == 404 and "no job" in refused.json()["error"]
        assert httpx.get(f"{keyed}/api/jobs/{job_id}", headers=auth).json()["id"] == job_id
        cancelled = httpx.delete(f"{keyed}/api/jobs/{job_id}", headers=auth)
        assert cancelled.json() == {"id": job_id, "cancelled": True, "was": "running"}
        last = [json.loads(line) for line in lines if line][-1]
        assert "cancel" in last["error"]
    assert httpx.delete(f"{keyed}/api/jobs/{job_id}", headers=auth).status_code == 404
    for made in (owner, other):
        KeyStore(r).revoke(made.id)


def test_a_client_that_leaves_cancels_every_choice(
    keyed: str, r: redis.Redis, slow: str, client: Client
) -> None:
    """n choices are n jobs: a streamed answer whose client goes away while they run (the
    slow model's) cancels every one of them."""
    key, token = KeyStore(r).create("choices")
    auth = {"Authorization": f"Bearer {token}"}
    body = {"model": slow, "prompt": "x", "n": 2, "stream": True, "max_tokens": 100_000}
    body["temperature"] = 0

    def listed() -> list[str]:
        return [job["id"] for job in httpx.get(f"{keyed}/api/jobs", headers=auth).json()["jobs"]]

    with httpx.stream("POST", f"{keyed}/v1/completions", json=body, headers=auth) as held:
        lines = held.iter_lines()  # kept: a line iterator let go closes the response
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["index"] in (0, 1)
        assert wait_for(lambda: len(listed()) == 2)  # both on the cluster
        ids = listed()
    assert wait_for(lambda: listed() == [])
    states = [custody.state if (custody := client.custody(job_id)) else None for job_id in ids]
    assert states == ["cancelled", "cancelled"]
    KeyStore(r).revoke(key.id)
    one_at_a_time, token = KeyStore(r).create("one", max_in_flight=1)
    refused = httpx.post(
        f"{keyed}/v1/completions",
        json={**body, "stream": False, "max_tokens": 2},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert refused.status_code == 403 and "at most 1" in refused.json()["error"]["message"]
    KeyStore(r).revoke(one_at_a_time.id)

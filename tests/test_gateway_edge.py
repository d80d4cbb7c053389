"""The gateway's edge: a keyless gateway answers this machine's names only (DNS rebinding),
pages of other sites are refused (cross-site requests) while this machine's own get CORS
headers, bodies are JSON sent as such, and a body over the limit is refused without being
read. Over real HTTP, against a real gateway."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import openai
import pytest
import redis

from api_client.gateway.edge import EdgeRules, host_allowed, host_name, origin_allowed
from scheduler.local.stack import LocalStack
from scheduler.store import keys
from tests.gateway_server import running_gateway

LIMIT = 4096


@pytest.fixture(scope="module")
def url(stack: LocalStack) -> Iterator[str]:
    settings = stack.settings.model_copy(
        update={"http_max_body_bytes": LIMIT, "http_origins": "https://chat.example.org"}
    )
    with running_gateway(settings) as base:
        yield base


def test_host_names_that_mean_this_machine() -> None:
    assert host_name("LocalHost:11434") == "localhost"
    assert host_name("[::1]:11434") == "::1"
    # names of this machine, and any address (only a name can be rebound): as Ollama's
    # OLLAMA_HOST=0.0.0.0 makes the official client send Host: 0.0.0.0:11434
    for host in ("localhost", "127.0.0.1:80", "[::1]:11434", "app.localhost", "0.0.0.0:11434"):
        assert host_allowed(host), host
    for host in ("10.0.0.5", "[::]:11434", "", "gpu.local", "box.internal"):
        assert host_allowed(host), host
    for host in ("evil.example", "evil.example:11434", "localhost.evil.example"):
        assert not host_allowed(host), host
    assert host_allowed("gpu-box.lan:11434", ["gpu-box.lan"])
    assert host_allowed("anything", ["*"])


def test_origins_of_this_machine_and_those_configured() -> None:
    for origin in ("http://localhost:3000", "https://127.0.0.1", "app://obsidian.md"):
        assert origin_allowed(origin), origin
    for origin in ("https://evil.example", "null", "http://localhost.evil.example"):
        assert not origin_allowed(origin), origin
    assert origin_allowed("https://chat.example.org", ["https://chat.example.org"])
    assert origin_allowed("https://a.example.org", ["https://*.example.org"])


def test_the_checks_in_order() -> None:
    rules = EdgeRules(check_host=True, max_body_bytes=100)
    json_post = {b"host": b"localhost", b"content-type": b"application/json"}
    assert rules.refusal("POST", {**json_post, b"content-length": b"10"}) is None
    assert rules.refusal("GET", {b"host": b"localhost"}) is None
    too_big = rules.refusal("POST", {**json_post, b"content-length": b"101"})
    assert too_big is not None and too_big.code == "request_too_large" and "100" in str(too_big)
    form = {b"host": b"localhost", b"content-type": b"application/x-www-form-urlencoded"}
    plain = rules.refusal("POST", {**form, b"content-length": b"2"})
    assert plain is not None and plain.code == "unsupported_media_type"
    assert "Content-Type: application/json" in str(plain)
    assert rules.refusal("POST", {**form, b"content-length": b"0"}) is None  # no body
    keyed = EdgeRules(check_host=False)
    assert keyed.refusal("GET", {b"host": b"gpu-box.example.org"}) is None


def test_a_request_by_a_name_of_another_site_is_refused(url: str) -> None:
    answer = httpx.get(f"{url}/api/tags", headers={"Host": "rebind.evil.example"})
    assert answer.status_code == 403
    assert "GGUFQ_HTTP_HOSTS" in answer.json()["error"]
    assert httpx.get(f"{url}/api/tags", headers={"Host": "localhost:11434"}).status_code == 200


def test_a_page_of_another_site_is_refused_and_ones_own_get_cors(url: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
    evil = httpx.post(f"{url}/api/generate", json=body, headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403 and "GGUFQ_HTTP_ORIGINS" in evil.json()["error"]
    assert "access-control-allow-origin" not in evil.headers
    own = httpx.get(f"{url}/api/tags", headers={"Origin": "http://localhost:3000"})
    assert own.status_code == 200
    assert own.headers["access-control-allow-origin"] == "http://localhost:3000"
    asked = httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": "https://chat.example.org",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert asked.status_code == 204
    assert asked.headers["access-control-allow-origin"] == "https://chat.example.org"
    assert "authorization" in asked.headers["access-control-allow-headers"]


def test_a_body_that_is_not_sent_as_json_is_refused(url: str) -> None:
    text = json.dumps({"model": "tiny", "prompt": "hi", "stream": False})
    for media in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": media} if media else {}
        answer = httpx.post(f"{url}/api/generate", content=text, headers=headers)
        assert answer.status_code == 415, media
        assert "application/json" in answer.json()["error"]
    openai_shaped = httpx.post(f"{url}/v1/chat/completions", content=text)
    assert openai_shaped.status_code == 415
    assert openai_shaped.json()["error"]["code"] == "unsupported_media_type"


def test_a_body_over_the_limit_is_refused_unread(url: str) -> None:
    prompt = "x" * (2 * LIMIT)
    declared = httpx.post(f"{url}/api/generate", json={"model": "tiny", "prompt": prompt})
    assert declared.status_code == 413 and f"{LIMIT:,} bytes" in declared.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    streamed = httpx.post(
        f"{url}/api/generate", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413
    with ollama.Client(host=url) as api:
        with pytest.raises(ollama.ResponseError) as refused:
            api.generate(model="tiny", prompt=prompt)
        assert refused.value.status_code == 413
        assert api.generate(model="tiny", prompt="hi", options={"num_predict": 2}).done


def test_a_schema_over_the_bounds_is_a_400_naming_the_limit(url: str) -> None:
    huge = {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000}
    with ollama.Client(host=url) as api:
        with pytest.raises(ollama.ResponseError) as refused:
            api.generate(model="tiny", prompt="numbers", format=huge)
    assert refused.value.status_code == 400
    assert "minItems is 100,000,000" in refused.value.error
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "numbers"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": huge}},
        )
    assert "at most 1,024" in str(bad.value)
    client.close()


def test_a_flood_of_maximal_requests_over_http_gets_typed_refusals(
    stack: LocalStack, r: redis.Redis
) -> None:
    """Redis with 64 MiB to spare: ten requests of the largest text at once through the
    gateway get 503 (Redis has no room, with Retry-After) or the job's own typed error,
    never a 500 from Redis, and a small request is served meanwhile."""
    before = r.config_get("maxmemory")["maxmemory"]
    for counted in r.scan_iter(f"{keys.MEMORY_ADMITTED}:*"):  # another test's, lately
        r.delete(counted)
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + (64 << 20))
    big = {"model": "tiny", "prompt": "x " * 2_000_000, "stream": False}
    big["options"] = {"num_predict": 1}
    try:
        with (
            running_gateway(stack.settings) as url,
            httpx.Client(timeout=120) as http,
            ThreadPoolExecutor(10) as pool,
        ):
            answers = list(
                pool.map(lambda _: http.post(f"{url}/api/generate", json=big), range(10))
            )
            small = http.post(
                f"{url}/api/generate",
                json={
                    "model": "tiny",
                    "prompt": "hi",
                    "stream": False,
                    "options": {"num_predict": 1},
                },
            )
    finally:
        r.config_set("maxmemory", before)
    statuses = sorted(a.status_code for a in answers)
    refused = [a for a in answers if a.status_code == 503]
    assert refused, statuses
    assert all("maxmemory" in a.json()["error"] for a in refused)  # no room, or Redis full
    assert all(a.headers.get("retry-after") for a in refused)
    assert all(a.status_code in (400, 503) for a in answers), statuses  # typed, each
    assert small.status_code == 200 and small.json()["done"]

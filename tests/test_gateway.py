"""The Ollama API of the gateway, driven by the official `ollama` package (Client and
AsyncClient, unmodified) and by raw HTTP, on a real gateway in front of the real stack."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from api_client import Client
from scheduler.local.stack import LocalStack
from tests.conftest import needs_tool, wait_for
from tests.gateway_server import running_gateway

GREEDY = {"temperature": 0, "num_predict": 16, "seed": 7}


@pytest.fixture(scope="module")
def url(stack: LocalStack) -> Iterator[str]:
    settings = stack.settings.model_copy(update={"http_keepalive_s": 0.3})
    with running_gateway(settings) as base:
        yield base


@pytest.fixture()
def api(url: str) -> Iterator[ollama.Client]:
    with ollama.Client(host=url) as client:
        yield client


def test_root_and_version(url: str) -> None:
    assert httpx.get(url).text == "Ollama is running"
    assert httpx.head(url).status_code == 200
    assert httpx.get(f"{url}/api/version").json()["version"]


def test_generate_matches_the_python_client(api: ollama.Client, client: Client) -> None:
    expected = client.chat("tiny", [{"role": "user", "content": "The sky is"}], options=GREEDY)
    answer = api.generate(model="tiny", prompt="The sky is", options=GREEDY)
    assert answer.done and answer.done_reason in ("stop", "length")
    assert answer.response == expected.response
    assert answer.eval_count and answer.prompt_eval_count and answer.total_duration
    parts = list(
        api.generate(model="tiny:latest", prompt="The sky is", options=GREEDY, stream=True)
    )
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response or "" for p in parts) == expected.response
    raw = api.generate(model="tiny", prompt="The sky is", options=GREEDY, raw=True)
    assert raw.response == client.generate("tiny", "The sky is", options=GREEDY).response


def test_chat_sync_and_async(url: str, client: Client) -> None:
    messages = [{"role": "user", "content": "the sky is"}]
    expected = client.chat("tiny", messages, options=GREEDY).response
    with ollama.Client(host=url) as sync:
        answer = sync.chat(model="tiny", messages=messages, options=GREEDY)
    assert answer.message.role == "assistant" and answer.message.content == expected

    async def main() -> tuple[str, str]:
        async with ollama.AsyncClient(host=url) as api:
            return await both(api)

    async def both(api: ollama.AsyncClient) -> tuple[str, str]:
        whole = await api.chat(model="tiny", messages=messages, options=GREEDY)
        parts = [
            p
            async for p in await api.chat(
                model="tiny", messages=messages, options=GREEDY, stream=True
            )
        ]
        assert parts[-1].done and parts[-1].done_reason
        return whole.message.content or "", "".join(p.message.content or "" for p in parts)

    assert asyncio.run(main()) == (expected, expected)


def test_missing_model_is_a_404_response_error(api: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        api.generate(model="nosuchmodel", prompt="hi")
    assert caught.value.status_code == 404 and "tiny" in caught.value.error
    with pytest.raises(ollama.ResponseError) as streamed:
        list(
            api.chat(model="nosuchmodel", messages=[{"role": "user", "content": "x"}], stream=True)
        )
    assert streamed.value.status_code == 404


def test_ndjson_framing(url: str) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "options": GREEDY}
    with httpx.stream("POST", f"{url}/api/generate", json=body) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines()]
    assert all(set(r) >= {"model", "created_at", "response", "done"} for r in lines)
    assert lines[-1]["done"] is True and lines[-1]["response"] == ""
    assert {"eval_count", "total_duration", "done_reason"} <= set(lines[-1])
    whole = httpx.post(f"{url}/api/generate", json={**body, "stream": False}, timeout=60).json()
    assert whole["response"] == "".join(r["response"] for r in lines)


def test_embed_and_legacy_embeddings(api: ollama.Client, client: Client) -> None:
    result = api.embed(model="tiny", input=["hello there", "a different text"])
    assert len(result.embeddings) == 2
    direct = client.embed("tiny", ["hello there", "a different text"]).embeddings
    assert [list(v) for v in result.embeddings] == direct
    legacy = api.embeddings(model="tiny", prompt="hello there")
    assert list(legacy.embedding) == pytest.approx(result.embeddings[0], abs=1e-6)
    short = api.embed(model="tiny", input="hello there", dimensions=8).embeddings[0]
    assert len(short) == 8 and abs(sum(v * v for v in short) - 1) < 1e-6


def test_list_show_and_ps(api: ollama.Client, client: Client) -> None:
    names = [m.model for m in api.list().models]
    assert "tiny" in names and "notgguf" not in names
    shown = api.show("tiny")
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert shown.details is not None and shown.details.family == "llama"
    client.load("tiny", keep_alive="5m")
    running = api.ps().models
    assert "tiny" in [m.model for m in running] and running[0].expires_at is not None


def test_empty_prompt_loads_and_keep_alive_zero_unloads(api: ollama.Client, client: Client) -> None:
    loaded = api.generate(model="tiny", prompt="", keep_alive="5m")
    assert loaded.done and loaded.done_reason == "load"
    assert wait_for(lambda: any(r.model == "tiny" and not r.embedding for r in client.ps()))
    gone = api.generate(model="tiny", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    assert wait_for(lambda: not [r for r in client.ps() if r.model == "tiny" and not r.embedding])


def test_model_files_are_not_managed_here(api: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError, match="GGUFQ_MODELS_DIR"):
        api.delete("tiny")
    with pytest.raises(ollama.ResponseError, match="GGUFQ_MODELS_DIR"):
        api.pull("nosuchmodel")
    assert api.pull("tiny").status == "success"


def test_unsupported_fields_are_a_clear_400(url: str) -> None:
    response = httpx.post(
        f"{url}/api/generate", json={"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"}
    )
    assert response.status_code == 400 and "raw" in response.json()["error"]
    bad = httpx.post(
        f"{url}/api/generate", json={"model": "tiny", "prompt": "x", "options": {"temperature": -3}}
    )
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]


def _readme_gateway_examples() -> tuple[list[str], list[str]]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("### From Ollama and OpenAI clients")[1].split("\n## ")[0]
    python = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    shell = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    curls = [line for block in shell for line in block.splitlines() if line.startswith("curl ")]
    return python, curls


@pytest.mark.parametrize("index", range(len(_readme_gateway_examples()[0])))
def test_readme_python_examples_run(url: str, index: int, stack: LocalStack) -> None:
    code = _readme_gateway_examples()[0][index]
    code = code.replace("gemma3-270m", "tiny").replace("http://localhost:11434", url)
    # the Python client's examples meet the same stack (and batch files) as the gateway
    env = {**os.environ, "OLLAMA_HOST": url, "GGUFQ_REDIS_URL": stack.redis_url}
    env["GGUFQ_DATA_DIR"] = str(stack.settings.data_dir)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{code}\n{out.stderr}"
    assert out.stdout.strip()


@needs_tool("curl", "apt-get install curl")
def test_readme_curl_examples_run(url: str) -> None:
    curls = _readme_gateway_examples()[1]
    assert len(curls) >= 3
    for command in curls:
        command = command.replace("gemma3-270m", "tiny").replace("http://localhost:11434", url)
        out = subprocess.run(
            [*shlex.split(command), "--fail-with-body", "-sS"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, f"{command}\n{out.stdout}{out.stderr}"
        assert out.stdout.strip()

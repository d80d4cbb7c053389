"""The OpenAI API of the gateway, driven by the official `openai` package (unmodified) on a
real gateway in front of the real stack."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import numpy as np
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from api_client import Client

OPTIONS = {"temperature": 0, "num_predict": 16, "seed": 7, "top_p": 1.0}
MESSAGES = [{"role": "user", "content": "the sky is"}]
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the sky is"}]


@pytest.fixture()
def api(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_chat_completion_with_and_without_stream(api: openai.OpenAI, client: Client) -> None:
    expected = client.chat("tiny", MESSAGES, options=OPTIONS).response
    answer = api.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=16, seed=7
    )
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            max_tokens=16,
            seed=7,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_async_chat(url: str, client: Client) -> None:
    expected = client.chat("tiny", MESSAGES, options=OPTIONS).response

    async def main() -> str:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as api:
            stream = await api.chat.completions.create(
                model="tiny", messages=CHAT, stream=True, temperature=0, max_tokens=16, seed=7
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream])

    assert asyncio.run(main()) == expected


def test_completion_is_raw_text(api: openai.OpenAI, client: Client) -> None:
    expected = client.generate("tiny", "Once upon a time", options=OPTIONS).response
    answer = api.completions.create(
        model="tiny", prompt="Once upon a time", temperature=0, max_tokens=16, seed=7
    )
    assert answer.choices[0].text == expected
    streamed = api.completions.create(
        model="tiny",
        prompt="Once upon a time",
        stream=True,
        temperature=0,
        max_tokens=16,
        seed=7,
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_embeddings_base64_by_default_and_float(api: openai.OpenAI, client: Client) -> None:
    direct = client.embed("tiny", ["hello there", "a different text"]).embeddings
    default = api.embeddings.create(model="tiny", input=["hello there", "a different text"])
    assert len(default.data) == 2
    for got, want in zip(default.data, direct, strict=True):
        assert got.embedding == pytest.approx(want, abs=1e-6)
    floats = api.embeddings.create(model="tiny", input="hello there", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(direct[0], abs=1e-6)
    raw = api.embeddings.with_raw_response.create(
        model="tiny", input="hello there", encoding_format="base64"
    ).http_response.json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(direct[0], abs=1e-6)


def test_models_list_and_errors(api: openai.OpenAI) -> None:
    ids = [m.id for m in api.models.list()]
    assert "tiny" in ids and "notgguf" not in ids
    assert api.models.retrieve("tiny").owned_by == "ggufq"
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="nosuchmodel", messages=CHAT)
    assert missing.value.code == "model_not_found" and "tiny" in missing.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.chat.completions.create(model="tiny", messages=CHAT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'g'"):
        api.chat.completions.create(
            model="tiny",
            messages=CHAT,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )


def test_response_format_json_object(api: openai.OpenAI) -> None:
    answer = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Reply in JSON"}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=24,
    )
    text = answer.choices[0].message.content or ""
    assert text.lstrip().startswith("{")


def test_n_choices_whole_and_streamed(api: openai.OpenAI) -> None:
    """n jobs of one request, answered as its n choices: seeded apart (seed + index), so
    each choice is the answer of its own seed, whole or streamed."""
    ask = {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    one = [
        api.chat.completions.create(messages=CHAT, **{**ask, "seed": 3 + i})  # type: ignore[call-overload]
        for i in range(3)
    ]
    expected = [o.choices[0].message.content for o in one]
    whole = api.chat.completions.create(messages=CHAT, n=3, **ask)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == expected
    assert whole.usage is not None
    assert whole.usage.completion_tokens == sum(o.usage.completion_tokens for o in one if o.usage)
    chunks = list(
        api.chat.completions.create(  # type: ignore[call-overload]
            messages=CHAT, n=3, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected
    finishes = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finishes) == [0, 1, 2] and chunks[-1].usage is not None
    completion = api.completions.create(model="tiny", prompt="the", n=2, max_tokens=4, seed=1)
    assert [c.index for c in completion.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="1 to 16 choices"):
        api.chat.completions.create(model="tiny", messages=CHAT, n=17)


def test_logprobs_on_chat_completions_and_ollama(api: openai.OpenAI, url: str) -> None:
    """Each token's log probability and its alternatives, in each API's shape, whole and
    streamed (the stream gives them with its choice's last chunk)."""
    ask = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0}
    whole = api.chat.completions.create(logprobs=True, top_logprobs=2, **ask)  # type: ignore[call-overload]
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content
    content = whole.choices[0].logprobs.content
    text = bytes(b for t in content for b in t.bytes or []).decode("utf-8", "replace")
    assert text == whole.choices[0].message.content  # a token may be part of a character
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    chunks = list(api.chat.completions.create(logprobs=True, stream=True, **ask))  # type: ignore[call-overload]
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in streamed)  # logprobs without top_logprobs
    legacy = api.completions.create(model="tiny", prompt="the", max_tokens=4, logprobs=3)
    found = legacy.choices[0].logprobs
    assert found is not None and legacy.usage is not None
    assert len(found.tokens or []) == legacy.usage.completion_tokens
    assert all(len(top) <= 3 for top in found.top_logprobs or [])
    assert found.text_offset is not None and found.text_offset[0] == 0
    with ollama.Client(host=url) as local:
        answer = local.chat(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=1, options=OPTIONS
        )
        assert answer.logprobs and len(answer.logprobs) == answer.eval_count
        assert all(len(t.top_logprobs or []) == 1 for t in answer.logprobs)
        plain = local.chat(model="tiny", messages=MESSAGES, options=OPTIONS)
        assert plain.logprobs is None

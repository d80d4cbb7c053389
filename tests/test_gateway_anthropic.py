"""Anthropic's Messages API on the gateway, driven by the official `anthropic` package
(unmodified) on a real gateway in front of the real stack (issue 35)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam, ToolParam

from api_client import Client

ASK: list[MessageParam] = [{"role": "user", "content": "the sky is"}]
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture()
def api(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        yield client


def test_a_message_whole_and_streamed_is_the_chat_answer(
    api: anthropic.Anthropic, client: Client
) -> None:
    options = {"temperature": 0, "num_predict": 16}
    expected = client.chat("tiny", [{"role": "user", "content": "the sky is"}], options=options)
    greedy = {"temperature": 0}  # older clients' field (today's send none: Anthropic's own)
    answer = api.messages.create(model="tiny", max_tokens=16, messages=ASK, extra_body=greedy)
    assert answer.role == "assistant" and answer.model == "tiny"
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].type == "text" and answer.content[0].text == expected.response
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.output_tokens == expected.eval_count
    with api.messages.stream(
        model="tiny", max_tokens=16, messages=ASK, extra_body=greedy
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.response
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason == answer.stop_reason


def test_a_tool_use_whole_and_streamed(api: anthropic.Anthropic) -> None:
    ask: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "weather in Rome?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0},
    }
    answer = api.messages.create(**ask)
    assert answer.stop_reason == "tool_use"
    (use,) = answer.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    assert isinstance(use.input, dict) and use.input["city"] in ("Paris", "Rome")
    with api.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", use.input)]
    # the result goes back, and the conversation goes on
    turns: list[MessageParam] = [
        *ask["messages"],
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                {"type": "text", "text": "and so?"},
            ],
        },
    ]
    more = api.messages.create(
        model="tiny", max_tokens=4, messages=turns, tools=[WEATHER], system="Be brief."
    )
    assert more.stop_reason in ("end_turn", "max_tokens")


def test_structured_output_follows_its_schema(api: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    answer = api.messages.create(
        model="tiny",
        max_tokens=64,
        messages=[{"role": "user", "content": "yes or no?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert answer.content[0].type == "text"
    assert json.loads(answer.content[0].text)["answer"] in ("yes", "no")


def test_errors_come_in_anthropics_shape(api: anthropic.Anthropic, url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        api.messages.create(model="nosuchmodel", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="'image' is not supported"):
        api.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        api.messages.create(model="tiny", max_tokens=4, messages=ASK, tools=[server_tool])
    for content in (["not a block"], 5, {"type": "text"}, [{"type": "text", "text": None}]):
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
        body = {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [result]}],
        }
        answer = httpx.post(f"{url}/v1/messages", json=body)
        assert answer.status_code == 400, (content, answer.text)
        assert "tool_result's content" in answer.json()["error"]["message"]
    no_max = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "messages": ASK})
    assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]
    assert no_max.json()["type"] == "error"


def test_count_tokens_is_what_the_job_would_be_given(
    api: anthropic.Anthropic, client: Client
) -> None:
    """count_tokens renders the request as its job would be (template, system, tools) and
    counts it with the model's vocabulary: the same as the job's prompt_eval_count."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the sky is"}]
    ran = client.chat("tiny", turns, options={"num_predict": 1})
    counted = api.messages.count_tokens(model="tiny", system="Be brief.", messages=ASK)
    assert counted.input_tokens == ran.prompt_eval_count
    tools = [{"type": "function", "function": {**WEATHER, "parameters": WEATHER["input_schema"]}}]
    with_tools = client.chat("tiny", turns, tools=tools, options={"num_predict": 1})
    counted = api.messages.count_tokens(
        model="tiny", system="Be brief.", messages=ASK, tools=[WEATHER]
    )
    assert counted.input_tokens == with_tools.prompt_eval_count > ran.prompt_eval_count
    with pytest.raises(anthropic.NotFoundError):
        api.messages.count_tokens(model="nosuchmodel", messages=ASK)


def test_a_stop_sequence_is_named_as_the_reason(api: anthropic.Anthropic, client: Client) -> None:
    options = {"temperature": 0, "num_predict": 16}
    whole = client.chat("tiny", [{"role": "user", "content": "the sky is"}], options=options)
    stop = whole.response.strip()[2:5]  # a string the answer holds, past its beginning
    assert len(stop) == 3
    greedy = {"temperature": 0}
    answer = api.messages.create(
        model="tiny",
        max_tokens=16,
        messages=ASK,
        stop_sequences=[stop, "never said"],
        extra_body=greedy,
    )
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
    assert answer.content[0].type == "text" and stop not in answer.content[0].text
    with api.messages.stream(
        model="tiny", max_tokens=16, messages=ASK, stop_sequences=[stop], extra_body=greedy
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop

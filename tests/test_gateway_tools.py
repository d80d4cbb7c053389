"""Tool calling through the gateway, driven by the official `openai` and `ollama` packages
on a real gateway in front of the real stack (issue 35).

The tiny model writes random text, so its calls come from constraints it cannot leave:
``tool_choice`` required or named (the grammar built from the tools' schemas), or, on
Ollama's API, a ``format`` in the generic call form, whose answer the gateway must then
recognise as a call by itself (the path a model that calls tools on its own takes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from api_client import Client
from scheduler.errors import InvalidRequest

CITIES = ["Paris", "Rome"]
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "weather in Paris?"}]
SAMPLING: dict[str, Any] = {"temperature": 0, "max_tokens": 200, "seed": 7}


@pytest.fixture()
def api(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_required_call_is_a_valid_call_of_an_offered_tool(api: openai.OpenAI) -> None:
    answer = api.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        **SAMPLING,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in CITIES
    else:
        assert arguments == {}


def test_a_named_call_streams_as_deltas_and_never_as_text(api: openai.OpenAI) -> None:
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
            **SAMPLING,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # the call's JSON is no text
    assert deltas[0].role == "assistant" and deltas[0].tool_calls  # the role comes first
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls and all(call.function and call.function.name == "get_weather" for call in calls)
    assert [call.index for call in calls] == list(range(len(calls)))
    for call in calls:
        assert call.function is not None
        assert json.loads(call.function.arguments or "")["city"] in CITIES
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_conversation_with_calls_and_their_answers_goes_on(api: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    answer = api.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        broken = json.loads(json.dumps(messages))
        broken[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
        api.chat.completions.create(model="tiny", messages=broken, max_tokens=8)


def _generic_form(tool: str) -> dict[str, Any]:
    """The JSON a template without a place for tools is asked to answer a call with."""
    parameters = WEATHER["function"].get("parameters", {})
    call = {
        "type": "object",
        "properties": {"name": {"const": tool}, "arguments": parameters},
        "required": ["name", "arguments"],
    }
    return {
        "type": "object",
        "properties": {
            "tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
        },
        "required": ["tool_calls"],
    }


def test_ollama_api_reads_a_call_the_model_wrote(url: str) -> None:
    with ollama.Client(host=url) as api:
        _ollama_call_and_answer(api)


def _ollama_call_and_answer(api: ollama.Client) -> None:
    tools = [dict(WEATHER)]
    options = {"temperature": 0, "num_predict": 200, "seed": 7}
    answer = api.chat(
        model="tiny",
        messages=ASK,
        tools=tools,
        format=_generic_form("get_weather"),
        options=options,
    )
    assert answer.message.content == ""
    (call,) = answer.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments["city"] in CITIES
    chunks = list(
        api.chat(
            model="tiny",
            messages=ASK,
            tools=tools,
            format=_generic_form("get_weather"),
            options=options,
            stream=True,
        )
    )
    assert "".join(c.message.content or "" for c in chunks) == ""
    streamed = [call for c in chunks for call in c.message.tool_calls or []]
    assert streamed == [call] and chunks[-1].done
    # the answer goes back as a tool message, by tool_name
    turns = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
    ]
    assert api.chat(model="tiny", messages=turns, tools=tools, options={"num_predict": 4}).done


def test_python_client_and_bad_tools(client: Client, url: str) -> None:
    final = client.chat(
        "tiny",
        [{"role": "user", "content": "what time is it?"}],
        tools=[TIME],
        tool_choice={"name": "get_time"},
        options={"temperature": 0, "num_predict": 200},
    )
    assert final.message is not None and final.message.tool_calls
    assert [c.function.name for c in final.message.tool_calls] == ["get_time"] * len(
        final.message.tool_calls
    )
    with pytest.raises(InvalidRequest, match="needs tools"):
        client.chat("tiny", [{"role": "user", "content": "x"}], tool_choice="required")
    bad_name = {"type": "function", "function": {"name": "no spaces please"}}
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "tools": [bad_name]},
    )
    assert response.status_code == 400 and "name" in response.json()["error"]["message"]

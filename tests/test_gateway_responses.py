"""OpenAI's Responses API on the gateway (stateless), driven by the official `openai`
package (unmodified) on a real gateway in front of the real stack (issue 35)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from api_client import Client

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture()
def api(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_response_whole_and_streamed_is_the_chat_answer(
    api: openai.OpenAI, client: Client
) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the sky is"}]
    expected = client.chat("tiny", turns, options={"temperature": 0, "num_predict": 16})
    ask: dict[str, Any] = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": "the sky is",
        "temperature": 0,
        "max_output_tokens": 16,
    }
    whole = api.responses.create(**ask)
    assert whole.output_text == expected.response
    assert whole.status in ("completed", "incomplete") and whole.usage is not None
    assert whole.usage.output_tokens == expected.eval_count
    events = list(api.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected.response
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == expected.response


def test_a_function_call_whole_streamed_and_answered(api: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": "tiny",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Rome?"}]}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 200,
    }
    whole = api.responses.create(**ask)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with api.responses.stream(**ask) as stream:
        streamed = stream.get_final_response()
    calls = [item for item in streamed.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (call.name, json.loads(call.arguments))
    ]
    # the Agents SDK's next turn: the call and its output as items, the whole conversation
    turns = [
        *ask["input"],
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    more = api.responses.create(model="tiny", input=turns, tools=[WEATHER], max_output_tokens=4)
    assert more.status in ("completed", "incomplete")


def test_what_is_not_served_is_a_clear_400(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        api.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="hosted tools"):
        api.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input_image"):
        image = {"type": "input_image", "image_url": "data:image/png;base64,"}
        api.responses.create(model="tiny", input=[{"role": "user", "content": [image]}])

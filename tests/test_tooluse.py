"""How offered tools reach a model's prompt, and which jobs with tools are refused
(scheduler/tooluse.py, scheduler/chat.py): pure, no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler.bounds import MAX_SCHEMA_BYTES
from scheduler.chat import render
from scheduler.errors import InvalidRequest
from scheduler.protocol import JobRequest, parse_request
from scheduler.tooluse import (
    GENERIC_INSTRUCTIONS,
    MAX_TOOLS,
    Tool,
    call_schema,
    has_tool_place,
    short_id,
    template_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [Tool.model_validate(WEATHER)]
CALL = {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "content": "sunny", "tool_name": "get_weather", "tool_call_id": "call_1"},
    {"role": "tool", "content": "rain", "tool_name": "get_weather", "tool_call_id": "call_2"},
]

# the shape of Qwen 2.5's template (Hermes tool calls), cut to what tools touch
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n"
    "</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the shape of Gemma's: user and assistant turns that must alternate, no place for tools
ALTERNATING = (
    "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
)


def test_a_template_with_a_place_for_tools_gets_them_and_the_calls() -> None:
    messages = template_messages(TURNS, TOOLS, native=True)
    tools = [t.model_dump(mode="json") for t in TOOLS]
    prompt = render(HERMES, messages, variables={"tools": tools})
    assert prompt.startswith("<|im_start|>system\n<tools>{") and '"get_weather"' in prompt
    assert prompt.count('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}') == 2
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert messages[1]["tool_calls"][0]["type"] == "function"
    # ids of 9 letters and digits (Mistral's templates refuse others), the same both sides
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == short_id("call_1")
    assert len(short_id("call_1")) == 9 and short_id("call_1").isalnum()
    assert messages[2]["name"] == "get_weather"


def test_templates_get_tools_natively_only_for_calls_that_are_read_back() -> None:
    assert has_tool_place(HERMES)
    assert has_tool_place("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]")
    granite = "{% if tools %}<|start_of_role|>tools{% endif %}<|tool_call|>"
    assert not has_tool_place(granite)  # its calls' format is not read: the generic form
    assert not has_tool_place(ALTERNATING)


def test_an_answer_by_call_id_alone_is_named_after_its_call() -> None:
    by_id = [{**m, "tool_name": None} if m["role"] == "tool" else m for m in TURNS]
    by_id = [{k: v for k, v in m.items() if v is not None} for m in by_id]
    messages = template_messages(by_id, TOOLS, native=False)
    assert messages[-1]["content"].startswith("The tool get_weather answered: sunny")


def test_a_template_without_one_gets_the_generic_form_in_alternating_turns() -> None:
    system = [{"role": "system", "content": "Be brief."}]
    messages = template_messages(system + TURNS, TOOLS, native=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith(GENERIC_INSTRUCTIONS)
    assert messages[0]["content"].endswith("\n\nBe brief.")
    written = json.loads(messages[2]["content"])
    assert written == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}] * 2}
    assert messages[3]["content"] == (
        "The tool get_weather answered: sunny\nThe tool get_weather answered: rain"
    )
    prompt = render(ALTERNATING, messages[1:])  # renders: the turns still alternate
    assert prompt.endswith("<assistant>")
    # no system turn (some templates have no system role): the tools head the first user turn
    alone = template_messages([*TURNS, {"role": "user", "content": "and so?"}], TOOLS, False)
    assert [m["role"] for m in alone] == ["user", "assistant", "user"]
    assert alone[0]["content"].startswith(GENERIC_INSTRUCTIONS)
    assert alone[0]["content"].endswith("\n\nweather in Paris and Rome?")
    assert alone[2]["content"].endswith("answered: rain\nand so?")  # one turn, alternating
    render(ALTERNATING, alone)


def test_a_required_call_has_a_schema_a_named_one_only_its_tool() -> None:
    other = Tool.model_validate({"function": {"name": "get_time"}})
    assert call_schema([*TOOLS, other], "auto", True) is None
    required = call_schema([*TOOLS, other], "required", False)
    assert required is not None
    calls = required["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and len(calls["items"]["anyOf"]) == 2
    named = call_schema([*TOOLS, other], parse_choice({"name": "get_time"}), True)
    assert named is not None
    item = named["properties"]["tool_calls"]["items"]
    assert item["properties"]["name"] == {"const": "get_time"}
    assert named["properties"]["tool_calls"]["maxItems"] == MAX_TOOLS


def parse_choice(choice: Any) -> Any:
    return parse_request(
        chat(tools=[WEATHER, {"function": {"name": "get_time"}}], tool_choice=choice)
    ).tool_choice


def big(n: int) -> dict[str, Any]:
    """A tool whose parameters take half of what one schema may."""
    described = {"type": "string", "description": "x" * (MAX_SCHEMA_BYTES // 2)}
    parameters = {"type": "object", "properties": {"a": described}}
    return {"function": {"name": f"tool{n}", "parameters": parameters}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"kind": "chat", "model": "m", "messages": [{"role": "user", "content": "x"}], **fields}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"name": "get_time"}}, "not among the tools"),
        ({"tools": [WEATHER, WEATHER]}, "share a name"),
        ({"tools": [WEATHER], "tool_choice": "required", "format": "json"}, "send one of them"),
        ({"kind": "generate", "prompt": "x", "tools": [WEATHER]}, "in a chat only"),
        ({"tools": [{"function": {"name": "has spaces"}}]}, "tools.0.function.name"),
        (
            {"tools": [{"function": {"name": "f", "parameters": {"maxItems": 10**9}}}]},
            "the parameters of tool 'f'.maxItems",
        ),
        (  # each tool within the bounds, all of them together over: their grammar too large
            {"tools": [big(n) for n in range(4)], "tool_choice": "required"},
            "the tools offered for a required call, together",
        ),
    ],
)
def test_tools_that_cannot_be_served_are_refused_with_the_reason(
    fields: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        parse_request(chat(**fields))


def test_calls_count_towards_the_jobs_size() -> None:
    plain = JobRequest.model_validate(chat())
    with_calls = JobRequest.model_validate(chat(messages=TURNS, tools=[WEATHER]))
    assert with_calls.chars > plain.chars + len(json.dumps(CALL["function"]["arguments"]))

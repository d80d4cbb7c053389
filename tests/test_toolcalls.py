"""Tool calls read out of what models write (scheduler/toolcalls.py): one table of
transcripts per format, written from each format's documentation (Hermes / Qwen 2.5, Llama
3.1-3.3, Mistral v3 and its 2025 templates, the generic JSON form), and the stream filter
that never shows a call's markup as text."""

from __future__ import annotations

import pytest

from scheduler.toolcalls import ToolCall, ToolCallStream, recognise

WEATHER = ToolCall("get_weather", {"city": "Paris"})
NAMES = frozenset({"get_weather", "get_time"})

CALLS = [
    # Hermes / Qwen 2.5: text, then one block per call
    (
        'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call>',
        "I will look it up.",
        [WEATHER],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "",
        [WEATHER, ToolCall("get_time", {"zone": "CET"})],
    ),
    # stopped at its closing tag (a stop string) before writing it
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    # Llama 3.1-3.3: the whole answer is the call, "parameters" for its arguments
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>',
        "",
        [WEATHER],
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [WEATHER, ToolCall("get_time", {})],
    ),
    # Mistral v3 and its 2025 templates
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>', "", [WEATHER]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [WEATHER]),
    (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [WEATHER, ToolCall("get_time", {})],
    ),
    # the generic JSON form, bare or fenced; arguments given as JSON text
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', "", [WEATHER]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "", [WEATHER]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', "", [WEATHER]),
    ('[{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]', "", [WEATHER]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CALLS)
def test_each_format_is_read(text: str, content: str, calls: list[ToolCall]) -> None:
    found = recognise(text, NAMES)
    assert (found.content, list(found.calls), found.malformed) == (content, calls, "")


ANSWERS = [
    "The weather in Paris is sunny, 21 degrees.",
    '{"city": "Paris", "temperature": 21}',  # JSON asked for, not a call
    "[1, 2, 3]",
    'Use {"name": ...} to call a tool.',  # a call's shape in prose
    '{"name": "rm_rf", "parameters": {}}',  # a tool nobody offered: its JSON is the answer
]


@pytest.mark.parametrize("text", ANSWERS)
def test_an_answer_without_a_call_is_content(text: str) -> None:
    found = recognise(text, NAMES)
    assert (found.content, found.calls, found.malformed) == (text, (), "")


MALFORMED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "<tool_call>"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "no tool offered"),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": ', "[TOOL_CALLS]"),
    ("[TOOL_CALLS]get_weather[ARGS]{oops}", "[TOOL_CALLS]"),
    ('<|python_tag|>brave_search.call(query="Paris")<|eom_id|>', "<|python_tag|>"),
]


@pytest.mark.parametrize(("text", "named"), MALFORMED)
def test_markup_that_opens_a_call_and_does_not_parse_is_named(text: str, named: str) -> None:
    """The caller answers with an error that shows the markup, not with an empty answer."""
    found = recognise(text, NAMES)
    assert found.calls == () and named in found.malformed and found.content == text


def stream(deltas: list[str]) -> tuple[list[str], str, tuple[ToolCall, ...]]:
    filtered = ToolCallStream(NAMES)
    shown = [filtered.feed(delta) for delta in deltas]
    return shown, filtered.end(), filtered.calls


def test_a_call_split_across_chunks_shows_none_of_its_markup() -> None:
    deltas = ["I will ", "look.", "<tool", "_call>", '{"name": "get_weather", ']
    deltas += ['"arguments": {"city": "Paris"}}', "</tool_call>"]
    shown, last, calls = stream(deltas)
    assert "".join(shown) == "I will look." and last == ""
    assert shown[1] == "look." and shown[2] == ""  # "<tool" held back as it came
    assert calls == (WEATHER,)


def test_text_then_a_call_then_text() -> None:
    deltas = ["Checking.", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}']
    deltas += ["</tool_call>", " Done."]
    shown, last, calls = stream(deltas)
    assert "".join(shown) == "Checking." and last.strip() == "Done." and calls == (WEATHER,)


def test_two_calls_in_a_whole_answer_show_nothing() -> None:
    deltas = ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "; "]
    deltas += ['{"name": "get_time", "parameters": {}}']
    shown, last, calls = stream(deltas)
    assert shown == ["", "", ""] and last == ""
    assert calls == (WEATHER, ToolCall("get_time", {}))


def test_what_only_looked_like_a_call_is_shown() -> None:
    shown, last, calls = stream(["a <", "b> and [TOOL", "S] too"])
    assert "".join(shown) + last == "a <b> and [TOOLS] too" and calls == ()
    assert shown[0] == "a "  # "<" waited for its next character
    shown, last, calls = stream(['{"city": ', '"Paris"}'])  # JSON that is the answer
    assert shown == ["", ""] and last == '{"city": "Paris"}' and calls == ()


def test_blank_space_before_a_whole_answer_call_is_no_text() -> None:
    more = ToolCallStream(NAMES)
    for delta in ["\n\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}']:
        assert more.feed(delta) == ""
    assert more.end() == "" and more.calls == (WEATHER,) and more.shown == ""


def test_a_call_cut_at_the_token_limit_is_left_out_and_named() -> None:
    for deltas in (
        ["Sure. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'],
        ['{"tool_calls": [{"name": "get_weather", "arguments": {"ci'],
    ):
        cut = ToolCallStream(NAMES)
        shown = "".join(cut.feed(delta) for delta in deltas)
        assert cut.end(cut=True) == "" and cut.calls == ()
        assert cut.malformed.startswith("cut at the token limit") and "{" not in shown
    answer = ToolCallStream(NAMES)  # JSON that is no call, cut: it is the answer
    answer.feed('{"city": "Par')
    assert answer.end(cut=True) == '{"city": "Par' and answer.malformed == ""


def test_brackets_nested_past_pythons_limit_are_text() -> None:
    deep = "[" * 5000
    found = recognise(deep, NAMES)
    assert found.calls == () and found.content == deep

"""Thinking apart from the answer (issue 35): the splitter's table (pure), and a model whose
chat template thinks, through the Python client and the three HTTP APIs with their
official clients (real gateway, real stack, real llama.cpp).

The test model's template opens ``<think>`` at the end of the prompt, as DeepSeek R1's
and Qwen 3's do, unless ``enable_thinking`` is false (then it writes an empty thought and
closes it): the random model never closes a thought itself, so with thinking on, all it
writes is thinking, and with it off, all is answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from api_client import Client
from scheduler.errors import InvalidRequest
from scheduler.thinking import ThinkSplitter, can_think, opens_thinking, template_switches
from tests.tinymodel import write_tiny_model

THINKS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "why?"}]
GREEDY = {"temperature": 0, "num_predict": 12}

SPLITS = [
    # (pieces, the prompt opened <think>, thinking, answer)
    (["<think>why not</think>\n\nBecause."], False, "why not", "Because."),
    (["<th", "ink>wh", "y</th", "ink>", " Be", "cause."], False, "why", "Because."),
    (["  \n<think>", "a<b</think>b"], False, "a<b", "b"),
    (["no thought, ", "<think>here is text"], False, "", "no thought, <think>here is text"),
    (["<", "b>bold</b>"], False, "", "<b>bold</b>"),
    (["thinking on", " and on</thi"], True, "thinking on and on</thi", ""),
    (["done</think>\n", "answer"], True, "done", "answer"),
    (["   "], False, "", ""),
]


@pytest.mark.parametrize(("pieces", "inside", "thinking", "answer"), SPLITS)
def test_thinking_parts_from_the_answer_however_the_text_is_cut(
    pieces: list[str], inside: bool, thinking: str, answer: str
) -> None:
    whole = ThinkSplitter(inside=inside)
    streamed = [whole.feed(piece) for piece in pieces] + [whole.end()]
    assert "".join(t for t, _ in streamed) == whole.thinking == thinking
    assert "".join(a for _, a in streamed) == whole.answer == answer
    by_char = ThinkSplitter(inside=inside)
    for char in "".join(pieces):
        by_char.feed(char)
    by_char.end()
    assert (by_char.thinking, by_char.answer) == (thinking, answer)


def test_templates_that_think_and_their_switches() -> None:
    assert can_think(THINKS) and can_think("{% if enable_thinking %}x{% endif %}")
    assert not can_think("{{ messages[0]['content'] }}")
    assert template_switches(None) == {}
    assert template_switches(False)["enable_thinking"] is False
    assert template_switches("high") == {
        "enable_thinking": True,
        "thinking": True,
        "reasoning_effort": "high",
    }
    assert opens_thinking("<|assistant|><think>\n")
    assert not opens_thinking("<think>\n\n</think>\n\n") and not opens_thinking("plain")


@pytest.fixture(scope="module")
def thinker(models_dir: Path) -> Iterator[str]:
    path = write_tiny_model(models_dir / "thinker.gguf", chat_template=THINKS)
    yield "thinker"
    path.unlink()


def test_the_python_client_gets_thinking_apart(client: Client, thinker: str) -> None:
    on = client.chat(thinker, ASK, think=True, options=GREEDY)
    assert on.message is not None and on.message.thinking and on.message.content == ""
    streamed = list(client.chat(thinker, ASK, think=True, options=GREEDY, stream=True))
    assert "".join(c.thinking for c in streamed if not c.done) == on.message.thinking
    assert "".join(c.response for c in streamed) == ""
    off = client.chat(thinker, ASK, think=False, options=GREEDY)
    assert off.message is not None and off.response and not off.message.thinking
    default = client.chat(thinker, ASK, options=GREEDY)  # the template's default: it thinks
    assert default.thinking == on.thinking
    with pytest.raises(InvalidRequest, match="'tiny' does not think"):
        client.chat("tiny", ASK, think=True, options=GREEDY)


def test_ollama_api_thinking(url: str, thinker: str) -> None:
    with ollama.Client(host=url) as api:
        whole = api.chat(model=thinker, messages=ASK, think=True, options=GREEDY)
        assert whole.message.thinking and whole.message.content == ""
        parts = list(api.chat(model=thinker, messages=ASK, think=True, options=GREEDY, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
        assert api.show(thinker).capabilities == ["completion", "tools", "thinking"]
        assert api.show("tiny").capabilities == ["completion", "tools"]
        generated = api.generate(model=thinker, prompt="why?", think=True, options=GREEDY)
        assert generated.thinking == whole.message.thinking and generated.response == ""
        with pytest.raises(ollama.ResponseError, match="does not think") as refused:
            api.chat(model="tiny", messages=ASK, think=True, options=GREEDY)
        assert refused.value.status_code == 400


def test_openai_api_reasoning_content(url: str, thinker: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as api:
        whole = api.chat.completions.create(
            model=thinker, messages=ASK, reasoning_effort="high", max_tokens=12, temperature=0
        )
        message = whole.choices[0].message
        assert (message.model_extra or {})["reasoning_content"] and not message.content
        chunks = api.chat.completions.create(
            model=thinker, messages=ASK, max_tokens=12, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thought = "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas)
        assert thought == (message.model_extra or {})["reasoning_content"]
        assert "".join(d.content or "" for d in deltas) == ""
        plain = api.chat.completions.create(
            model=thinker, messages=ASK, reasoning_effort="none", max_tokens=12, temperature=0
        )
        assert plain.choices[0].message.content
        assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


def test_anthropic_api_thinking_blocks(url: str, thinker: str) -> None:
    ask = {
        "model": thinker,
        "max_tokens": 12,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as api:
        whole = api.messages.create(**ask)  # type: ignore[arg-type]
        assert [b.type for b in whole.content] == ["thinking"]
        with api.messages.stream(**ask) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        assert final.content[0].type == "thinking" and whole.content[0].type == "thinking"
        assert final.content[0].thinking == whole.content[0].thinking
        off = api.messages.create(**{**ask, "thinking": {"type": "disabled"}})  # type: ignore[arg-type]
        assert [b.type for b in off.content] == ["text"]

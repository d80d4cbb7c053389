"""A prompt the context cannot hold: a 400 that says so, or, with ``truncate``, cut to fit
(a chat's oldest turns, a prompt's beginning) with a warning that says what was left out."""

from __future__ import annotations

import httpx
import pytest

from api_client import Client, InvalidRequest
from scheduler.local.stack import LocalStack
from scheduler.protocol import Message
from tests.gateway_server import running_gateway
from workers.fitting import fit_chat, fit_prompt, room_to_generate


def words(text: str) -> int:
    return len(text.split())


def render(messages: list[Message]) -> str:
    return " ".join(f"{m.role}: {m.content}" for m in messages)


def talk(*turns: tuple[str, str]) -> list[Message]:
    return [Message(role=role, content=content) for role, content in turns]  # type: ignore[arg-type]


def test_a_chat_loses_its_oldest_turns_and_keeps_its_system_and_last_user_turn() -> None:
    chat = talk(
        ("system", "be brief"),
        ("user", "one two three"),
        ("assistant", "four five"),
        ("user", "six"),
        ("assistant", "seven"),
        ("user", "eight"),
    )
    assert fit_chat(chat, render, words, 100).messages == 0
    # "system: be brief user: six assistant: seven user: eight" is 9 words: the cut falls
    # where a user turn begins, as few turns as fit
    fitted = fit_chat(chat, render, words, 9)
    assert fitted.messages == 2 and fitted.chars == 0
    assert fitted.prompt == "system: be brief user: six assistant: seven user: eight"
    assert "its 2 oldest messages were left out" in (fitted.warning() or "")
    assert fit_chat(chat, render, words, 5).prompt == "system: be brief user: eight"
    # not even the system and last message fit, and the last turn has nothing to cut: the
    # whole, for the slot's own 400
    assert fit_chat(chat, render, words, 4) == fit_chat(chat, render, words, 1000)


def test_a_tool_answer_never_loses_its_call() -> None:
    chat = talk(("user", "a b c d"), ("assistant", "x"), ("tool", "y"), ("user", "z"))
    # cutting after the call would fit 4 words, but a cut falls only where a user turn begins
    assert fit_chat(chat, render, words, 6).prompt == "user: z"
    # a chat that ends with a tool's answer keeps the call and its user turn
    called = talk(
        ("user", "a b"), ("assistant", "x"), ("user", "c"), ("assistant", "y"), ("tool", "t")
    )
    assert fit_chat(called, render, words, 6).prompt == "user: c assistant: y tool: t"


def test_a_one_turn_chat_loses_its_beginning_and_a_refused_rendering_does_not_fit() -> None:
    (one,) = talk(("user", "a b c d e f"))
    fitted = fit_chat([one], render, words, 4)  # "user:" and three words
    assert fitted.prompt == "user:  d e f" and fitted.chars == 5 and fitted.messages == 0
    assert "first 5 characters" in (fitted.warning() or "")

    def alternating(messages: list[Message]) -> str:
        if messages and messages[0].role != "user":
            raise InvalidRequest("conversation roles must alternate user/assistant")
        return render(messages)

    chat = talk(("user", "a b c"), ("assistant", "d"), ("user", "e"))
    assert fit_chat(chat, alternating, words, 2).prompt == "user: e"


def test_a_prompt_loses_its_beginning_and_room_is_left_to_generate() -> None:
    fitted = fit_prompt("a b c d e f", words, 3)
    assert fitted.prompt == " d e f" and fitted.chars == 5  # the least cut that fits
    assert fit_prompt("a b", words, 3).chars == 0
    assert room_to_generate(1000, 100) == 100
    assert room_to_generate(1000, -1) == 250 and room_to_generate(1000, 900) == 500


def long_chat() -> list[dict[str, str]]:
    turns = [{"role": "system", "content": "You answer briefly."}]
    for i in range(40):
        turns += [
            {"role": "user", "content": f"question {i} " + "word " * 10},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    return [*turns, {"role": "user", "content": "the last question"}]


def test_a_chat_past_its_context_is_refused_unless_truncated(client: Client) -> None:
    options = {"num_ctx": 128, "num_predict": 8, "temperature": 0}
    with pytest.raises(InvalidRequest, match="shorten the prompt or raise options.num_ctx"):
        client.chat("tiny", long_chat(), options=options)
    answer = client.chat("tiny", long_chat(), options=options, truncate=True)
    assert answer.eval_count and answer.prompt_eval_count
    assert answer.prompt_eval_count <= 128 - 8
    (warning,) = [w for w in answer.warnings if "truncate" in w]
    assert "oldest messages were left out" in warning
    plain = client.generate("tiny", "word " * 400, options=options, truncate=True)
    assert plain.prompt_eval_count and plain.prompt_eval_count <= 128 - 8
    assert any("first" in w and "characters" in w for w in plain.warnings)


def test_ollamas_truncate_on_chat(stack: LocalStack) -> None:
    body = {
        "model": "tiny",
        "messages": long_chat(),
        "stream": False,
        "options": {"num_ctx": 128, "num_predict": 4, "temperature": 0},
    }
    with running_gateway(stack.settings) as url:
        refused = httpx.post(f"{url}/api/chat", json=body, timeout=60)
        cut = httpx.post(f"{url}/api/chat", json={**body, "truncate": True}, timeout=60)
    assert refused.status_code == 400 and "num_ctx" in refused.json()["error"]
    assert cut.status_code == 200 and cut.json()["done"] is True
    # a prompt that /api/generate renders as a one-turn chat loses its beginning
    prompt = {**body, "prompt": "word " * 400}
    del prompt["messages"]
    with running_gateway(stack.settings) as url:
        long = httpx.post(f"{url}/api/generate", json={**prompt, "truncate": True}, timeout=60)
    assert long.status_code == 200 and long.json()["prompt_eval_count"] <= 128 - 4

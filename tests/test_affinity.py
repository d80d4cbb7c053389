"""Prefix keys and the bounded map from a key to the runner that last served it."""

from __future__ import annotations

import pytest

from scheduler.placement.affinity import AffinityMap, chat_key, prefix_key
from scheduler.protocol import Message


def test_prefix_key_depends_on_the_leading_characters_only() -> None:
    doc = "x" * 300
    assert prefix_key(doc + " first question") == prefix_key(doc + " another question")
    assert prefix_key("a" + doc) != prefix_key("b" + doc)
    assert prefix_key("abc", chars=2) == prefix_key("abd", chars=2)
    assert prefix_key("abc", scope="m1") != prefix_key("abc", scope="m2")
    assert len(prefix_key("abc")) == 16 and int(prefix_key("abc"), 16) >= 0


def chat(*turns: tuple[str, str]) -> list[Message]:
    return [Message(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]


def test_every_turn_of_a_conversation_has_the_key_of_its_first_messages() -> None:
    system = ("system", "You are a careful assistant. " * 40)  # longer than the cut
    first = chat(system, ("user", "What is a GGUF file?"))
    later = chat(
        system,
        ("user", "What is a GGUF file?"),
        ("assistant", "A model file format."),
        ("user", "And how large are they?"),
    )
    other = chat(system, ("user", "Tell me about Redis."))
    assert chat_key(first) == chat_key(later)
    assert chat_key(first) != chat_key(other)  # one long system prompt, two conversations
    assert chat_key(first, scope="m") != chat_key(first)


def test_the_map_is_bounded_and_drops_the_least_recently_used() -> None:
    m = AffinityMap(max_size=2)
    m.put("k1", "r1")
    m.put("k2", "r2")
    assert m.get("k1") == "r1"  # k1 used: k2 is now the oldest
    m.put("k3", "r1")
    assert len(m) == 2 and m.get("k2") is None and "k2" not in m
    assert m.get("k3") == "r1"
    m.put("k3", "r2")  # moved
    assert m.forget_runner("r1") == 1 and m.get("k1") is None and m.get("k3") == "r2"
    assert m.forget_runner("r1") == 0
    assert m.forget_runner("r2") == 1 and len(m) == 0


def test_the_default_bound() -> None:
    m = AffinityMap()
    for i in range(10_050):
        m.put(f"k{i}", f"r{i % 7}")
    assert len(m) == 10_000 and m.get("k49") is None and m.get("k50") == "r1"
    assert sum(m.forget_runner(f"r{i}") for i in range(7)) == 10_000


def test_a_map_needs_room_for_one_entry() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AffinityMap(0)

"""Thinking: what a reasoning model writes before its answer, kept apart from the answer
(issue 35). Pure: no I/O.

Models that think (Qwen 3, DeepSeek R1, QwQ, and the many trained like them) write their
reasoning between ``<think>`` and ``</think>``, then the answer; some templates open the
``<think>`` themselves at the end of the prompt, so the model's text begins inside it.
:class:`ThinkSplitter` sits on a stream of text deltas and parts each into thinking and
answer, holding back what may be the start of a tag, so a tag is never shown as either.

A template says it can think when it mentions ``<think>`` or an ``enable_thinking``
switch; it is rendered with ``enable_thinking`` and ``thinking`` (the switches templates
read) and ``reasoning_effort`` (``low`` / ``medium`` / ``high``) set from the job's
``think``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Think = bool | Literal["low", "medium", "high"] | None
OPEN, CLOSE = "<think>", "</think>"


def can_think(template: str) -> bool:
    """Whether a chat template has a thinking mode."""
    return OPEN in template or "enable_thinking" in template


def template_switches(think: Think) -> dict[str, Any]:
    """The variables a template reads for ``think`` (none when the job leaves it unset: the
    template's own default)."""
    if think is None:
        return {}
    on = think is not False
    effort = think if isinstance(think, str) else "medium"
    return {"enable_thinking": on, "thinking": on, "reasoning_effort": effort}


def opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` open: the model starts inside it."""
    at = prompt.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt[at:]


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


@dataclass
class ThinkSplitter:
    """Text deltas in, (thinking, answer) deltas out. Thinking is what comes between
    ``<think>`` and ``</think>`` at the start of the text (after blank space), or from the
    start when the prompt opened it (``inside``); everything else is answer. The blank
    space right after ``</think>`` is dropped."""

    inside: bool = False
    thinking: str = ""  # all the thinking passed on
    answer: str = ""  # all the answer passed on
    _held: str = ""
    _state: Literal["start", "thinking", "after", "answer"] = "start"

    def __post_init__(self) -> None:
        if self.inside:
            self._state = "thinking"

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        thought, said = "", ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self._state = stripped[len(OPEN) :], "thinking"
                elif not stripped or OPEN.startswith(stripped):
                    self._held = text  # blank, or "<thi": wait for more
                    text = ""
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                at = text.find(CLOSE)
                if at >= 0:
                    thought += text[:at]
                    text, self._state = text[at + len(CLOSE) :], "after"
                else:
                    keep = _partial_tail(text, CLOSE)
                    thought += text[: len(text) - keep]
                    self._held, text = text[len(text) - keep :], ""
            elif self._state == "after":
                text = text.lstrip()
                if text:
                    self._state = "answer"
            else:
                said += text
                text = ""
        self.thinking += thought
        self.answer += said
        return thought, said

    def end(self) -> tuple[str, str]:
        """The text ended: what was held back, as what it turned out to be."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            self.thinking += held
            return held, ""
        if self._state == "start" and held.strip():
            self.answer += held
            return "", held
        return "", ""

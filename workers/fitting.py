"""A prompt cut to fit its slot, for a job that sets ``truncate`` (Ollama's, on /api/chat
and /api/generate): without it a prompt the slot cannot hold is a 400 that says so.

A chat loses its oldest turns: every system message and the last user turn stay, and a
cut falls only where a user turn begins, so that the rest still alternates as templates
demand (a tool's answer never loses its call); when that is still too long, the last user
turn loses its beginning (a one-turn chat, as /api/generate makes of a prompt, too). A
plain prompt loses its beginning. Either
way the prompt leaves room to generate: ``num_predict`` tokens when the job sets it,
else a quarter of the slot, and never more than half of it.

Pure: the rendering and the counting of tokens are the caller's (the worker passes the
model's template and tokenizer). Each fit is a binary search: a handful of renders, not
one per message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.errors import InvalidRequest
from scheduler.protocol import Message


def room_to_generate(num_ctx: int, num_predict: int) -> int:
    """Tokens of a slot a cut prompt leaves free."""
    wanted = num_predict if num_predict > 0 else num_ctx // 4
    return max(1, min(wanted, num_ctx // 2))


@dataclass(frozen=True)
class Fitted:
    prompt: str
    messages: int = 0  # messages left out (a chat's oldest)
    chars: int = 0  # characters cut from the beginning (of a prompt, or a chat's last turn)

    def warning(self) -> str | None:
        parts = []
        if self.messages:
            parts.append(f"its {self.messages} oldest messages")
        if self.chars:
            parts.append(f"the first {self.chars} characters of its last turn or prompt")
        if not parts:
            return None
        return (
            f"the prompt did not fit the context: {' and '.join(parts)} were left out "
            "(truncate); raise options.num_ctx to keep them"
        )


def _first_fit(n: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest i in [0, n) with fits(i), fits being monotone; None when none fits."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < n else None


def fit_chat(
    messages: Sequence[Message],
    render: Callable[[list[Message]], str],
    count: Callable[[str], int],
    limit: int,
) -> Fitted:
    """The conversation rendered within ``limit`` tokens: its oldest turns left out as
    needed, and when the system messages and the last user turn on their own are still
    too long, that turn's beginning cut. The whole, unfitted, when nothing fits (the
    slot's own 400 then says so). A rendering the template refuses counts as too long."""
    whole = render(list(messages))
    if count(whole) <= limit:
        return Fitted(whole)
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        return Fitted(whole)
    cuts = [i for i in users if i > 0]  # where a cut may fall: where a user turn begins

    def kept(cut: int) -> list[Message]:
        return [m for i, m in enumerate(messages) if i >= cut or m.role == "system"]

    rendered: dict[int, str] = {}

    def fits(k: int) -> bool:
        try:
            rendered[k] = render(kept(cuts[k]))
        except InvalidRequest:
            return False
        return count(rendered[k]) <= limit

    k = _first_fit(len(cuts), fits)
    if k is not None:
        return Fitted(rendered[k], len(messages) - len(kept(cuts[k])))
    # the last user turn and what follows it, that turn's beginning cut
    last = users[-1]
    rest, turn = kept(last), messages[last]
    at = rest.index(turn)
    turn_texts: dict[int, str] = {}

    def cut_fits(i: int) -> bool:
        shorter = [
            *rest[:at],
            turn.model_copy(update={"content": turn.content[i:]}),
            *rest[at + 1 :],
        ]
        try:
            turn_texts[i] = render(shorter)
        except InvalidRequest:
            return False
        return count(turn_texts[i]) <= limit

    start = _first_fit(len(turn.content), cut_fits)
    if start is None:
        return Fitted(whole)
    return Fitted(turn_texts[start], len(messages) - len(rest), start)


def fit_prompt(prompt: str, count: Callable[[str], int], limit: int) -> Fitted:
    """``prompt`` within ``limit`` tokens: the least of its beginning cut that makes it fit."""
    if count(prompt) <= limit:
        return Fitted(prompt)
    start = _first_fit(len(prompt), lambda i: count(prompt[i:]) <= limit)
    if start is None:
        return Fitted(prompt)
    return Fitted(prompt[start:], chars=start)

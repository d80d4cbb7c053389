"""A prompt cut to fit its slot, for a job that sets ``truncate`` (Ollama's, on /api/chat
and /api/generate): without it a prompt the slot cannot hold is a 400 that says so.

A chat loses its oldest turns: every system message and the last message stay, and a cut
falls only where a user turn begins, so that the rest still alternates as templates
demand (a tool's answer never loses its call). A plain prompt loses its beginning. Either
way the prompt leaves room to generate: ``num_predict`` tokens when the job sets it,
else a quarter of the slot, and never more than half of it.

Pure: the rendering and the counting of tokens are the caller's (the worker passes the
model's template and tokenizer). Each fit is a binary search: a handful of renders, not
one per message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.protocol import Message


def room_to_generate(num_ctx: int, num_predict: int) -> int:
    """Tokens of a slot a cut prompt leaves free."""
    wanted = num_predict if num_predict > 0 else num_ctx // 4
    return max(1, min(wanted, num_ctx // 2))


@dataclass(frozen=True)
class Fitted:
    prompt: str
    left_out: int  # messages (a chat) or characters (a prompt) cut

    def warning(self, chat: bool) -> str | None:
        if not self.left_out:
            return None
        what = "oldest messages" if chat else "first characters of the prompt"
        return (
            f"the prompt did not fit the context: its {self.left_out} {what} were left out "
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
    """The conversation rendered within ``limit`` tokens, its oldest turns left out as
    needed; the whole of it rendered when even the shortest does not fit (the slot's
    own 400 then says so)."""
    whole = render(list(messages))
    if count(whole) <= limit:
        return Fitted(whole, 0)
    last = len(messages) - 1
    # where a cut may fall: where a user turn begins, and before the last message
    cuts = [i for i, m in enumerate(messages) if m.role == "user" and 0 < i < last] + [last]

    def kept(cut: int) -> list[Message]:
        return [m for i, m in enumerate(messages) if i >= cut or m.role == "system"]

    rendered: dict[int, str] = {}

    def fits(k: int) -> bool:
        rendered[k] = render(kept(cuts[k]))
        return count(rendered[k]) <= limit

    k = _first_fit(len(cuts), fits)
    if k is None:
        return Fitted(whole, 0)
    return Fitted(rendered[k], len(messages) - len(kept(cuts[k])))


def fit_prompt(prompt: str, count: Callable[[str], int], limit: int) -> Fitted:
    """``prompt`` within ``limit`` tokens: the least of its beginning cut that makes it fit."""
    if count(prompt) <= limit:
        return Fitted(prompt, 0)
    start = _first_fit(len(prompt), lambda i: count(prompt[i:]) <= limit)
    if start is None:
        return Fitted(prompt, 0)
    return Fitted(prompt[start:], start)

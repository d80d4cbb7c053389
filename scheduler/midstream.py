"""A job that goes on elsewhere from its last token when its worker dies mid-answer.

Every chunk a worker streams carries the token ids generated since its previous chunk
(:data:`TOKENS`; readers never see them). When a running job's worker is declared dead,
placement places it again with a :class:`Resumed` note (:func:`why_not_resumed` says when
it may not). The new run reads what the stream holds (:class:`SoFar`), evaluates the prompt
and those tokens as one prompt, replays their text through its stop strings, characters,
thinking and tool calls, drops what the stream has already (:class:`Skip`), and streams
on from the next seq. Greedy decoding gives the same tokens as a run without the fault
(with flash attention off: a prefix evaluated in one batch rounds differently from token
by token).

Pure: no Redis, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

TOKENS = "tokens"  # a chunk's token ids: those generated since the job's previous chunk
TEXTS = ("response", "thinking")


class Resumed(BaseModel):
    """One time a job went on elsewhere: the run that stopped, and when it was sent on."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker: str  # the worker whose run stopped
    device: str
    chunks: int  # chunks that run had streamed (all runs before it included)
    at: float  # wall time placement sent the job on
    went_on_s: float | None = None  # from ``at`` to the new run's first new text


def why_not_resumed(kind: str, logprobs: bool, resumed: int, resume_max: int) -> str:
    """Why a job that streamed cannot go on elsewhere ("" when it can): ``resumed`` times
    it went on already, at most ``resume_max`` (GGUFQ_RESUME_MAX)."""
    if kind == "embed":
        return "an embedding is not streamed"
    if logprobs:
        return "it asked for logprobs, which a resumed run cannot give for the tokens before"
    if resumed >= resume_max:
        times = "once" if resumed == 1 else f"{resumed} times"
        return (
            f"it had gone on elsewhere {times} already (GGUFQ_RESUME_MAX={resume_max})"
            if resumed
            else "GGUFQ_RESUME_MAX is 0"
        )
    return ""


@dataclass(frozen=True)
class SoFar:
    """What a job's stream holds of its answer: its tokens, its text and thinking, and the
    seq of its last chunk. ``complete``: the chunks run 1, 2, 3, ... with none missing
    (Redis lost none, nor the writer), and every chunk with text carried its tokens (a
    chunk an older worker wrote has none): else the answer cannot go on from it."""

    tokens: tuple[int, ...] = ()
    response: str = ""
    thinking: str = ""
    seq: int = 0
    complete: bool = True

    @classmethod
    def of(cls, chunks: list[dict[str, Any]]) -> SoFar:
        tokens: list[int] = []
        texts = {name: [] for name in TEXTS}  # type: dict[str, list[str]]
        seq, complete = 0, True
        for chunk in chunks:
            if chunk.get("done"):
                break
            complete = complete and int(chunk.get("seq", -1)) == seq + 1
            seq = int(chunk.get("seq", seq + 1))
            has_text = False
            for name in TEXTS:
                if chunk.get(name):
                    texts[name].append(chunk[name])
                    has_text = True
            if TOKENS in chunk:
                tokens += [int(t) for t in chunk[TOKENS]]
            elif has_text:
                complete = False
        return cls(
            tuple(tokens), "".join(texts["response"]), "".join(texts["thinking"]), seq, complete
        )


class Skip:
    """Trims from a resumed run's chunks the text its stream holds already: the run replays
    the answer's tokens so far, and their text comes out again, in the same order."""

    __slots__ = ("left",)

    def __init__(self, so_far: SoFar) -> None:
        self.left = {"response": len(so_far.response), "thinking": len(so_far.thinking)}

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """``chunk`` with what was streamed cut off; None when nothing of it is new."""
        if not any(self.left.values()):
            return chunk
        out = dict(chunk)
        for name in TEXTS:
            text, left = out.get(name), self.left[name]
            if not text or not left:
                continue
            cut = min(len(text), left)
            self.left[name] = left - cut
            if text[cut:]:
                out[name] = text[cut:]
            else:
                del out[name]
        return out if any(out.get(name) for name in TEXTS) else None


def for_readers(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk as readers get it: without its token ids."""
    chunk.pop(TOKENS, None)
    return chunk

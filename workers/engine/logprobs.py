"""A generated token's log probability, and its most likely alternatives, from the
model's logits at that step (before the sampler's temperature, top-k/p and penalties: the
model's own distribution, as OpenAI's and Ollama's logprobs are). Pure numpy: the logits
and a token's bytes in, one entry out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MAX_TOP = 20  # alternatives a token may come with (OpenAI's and Ollama's bound)


def entry(token: int, logprob: float, data: bytes) -> dict[str, Any]:
    """One token as logprobs list it: its text (a piece of a character is U+FFFD), its
    log probability, its bytes."""
    text = data.decode("utf-8", errors="replace")
    return {"token": text, "logprob": logprob, "bytes": list(data)}


def token_logprobs(
    logits: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]
) -> dict[str, Any]:
    """``token``'s entry with its ``top`` most likely alternatives (at most MAX_TOP)."""
    peak = float(logits.max())
    total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    out = entry(token, float(logits[token]) - total, piece(token))
    alternatives: list[dict[str, Any]] = []
    top = min(top, MAX_TOP, len(logits))
    if top > 0:
        best = np.argpartition(logits, -top)[-top:]
        for other in sorted(best, key=lambda t: -float(logits[t])):
            alternatives.append(entry(int(other), float(logits[other]) - total, piece(int(other))))
    out["top_logprobs"] = alternatives
    return out

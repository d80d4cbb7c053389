"""Text and tokens: a prompt's tokens, and from sampled tokens to the text a caller sees.

:class:`Tokenizer` turns a prompt into tokens and a sampled token into its bytes with the
model's vocabulary (through the llama.cpp module it is handed). A piece may end inside a
character (:class:`Utf8Stream`), stop strings are cut and never emitted
(:class:`StopMatcher`), a job generates within its budget (:func:`token_budget`), and a
finished job reports :class:`GenerationStats`.
"""

from __future__ import annotations

import codecs
import ctypes
from dataclasses import dataclass
from typing import Any

from scheduler.errors import InvalidRequest


@dataclass
class GenerationStats:
    text: str
    done_reason: str
    prompt_eval_count: int
    prompt_eval_duration_ns: int
    eval_count: int
    eval_duration_ns: int
    admitted_ns: int = 0  # perf_counter_ns when the job got its slot

    def ollama_fields(self) -> dict[str, Any]:
        """The final record's fields under Ollama's names."""
        return {
            "response": self.text,
            "done_reason": self.done_reason,
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": self.prompt_eval_duration_ns,
            "eval_count": self.eval_count,
            "eval_duration": self.eval_duration_ns,
        }


class StopMatcher:
    """Cuts streamed text at the first stop string, never emitting any part of it.

    Text that could be the beginning of a stop string is held back until the next piece
    shows whether it is one.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max(_prefix_overlap(buf, s) for s in self.stops)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a generation that met no stop string."""
        held, self.held = self.held, ""
        return held


def _prefix_overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class Utf8Stream:
    """Decodes token pieces whose bytes may split a character between two tokens."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def token_budget(num_predict: int, num_ctx: int, n_prompt: int) -> int:
    """New tokens a job may generate: ``num_predict`` (-1, -2: unbounded) within its slot."""
    room = num_ctx - n_prompt
    return room if num_predict < 0 else min(num_predict, room)


class Tokenizer:
    """A model's vocabulary both ways: a prompt's tokens, and each token's bytes and whether
    it ends a generation (looked up in llama.cpp once per token)."""

    def __init__(self, L: Any, vocab: Any) -> None:
        self._L = L
        self.vocab = vocab
        self.bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else -1
        self._pieces: dict[int, tuple[bytes, bool]] = {}

    def tokenize(self, text: str) -> list[int]:
        """As llama-cpp-python tokenizes a completion prompt: special tokens parsed, BOS
        added when the model asks for it."""
        L = self._L
        data = text.encode()
        buf = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        tokens = list(buf[:n])
        if self.bos >= 0:
            tokens.insert(0, self.bos)
        if not tokens:
            raise InvalidRequest("the prompt is empty; give at least one character")
        return tokens

    def piece(self, token: int) -> tuple[bytes, bool]:
        cached = self._pieces.get(token)
        if cached is None:
            L = self._L
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            cached = (buf.raw[:n], bool(L.llama_vocab_is_eog(self.vocab, token)))
            self._pieces[token] = cached
        return cached

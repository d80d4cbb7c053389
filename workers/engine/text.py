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

import numpy as np

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
    logprobs: list[dict[str, Any]] | None = None  # each token's, when the job asked
    stop_sequence: str | None = None  # the stop string that ended it
    prompt_cached_count: int = 0  # prompt tokens its slot's cache held: not evaluated again

    def ollama_fields(self) -> dict[str, Any]:
        """The final record's fields under Ollama's names."""
        return (
            {
                "response": self.text,
                "done_reason": self.done_reason,
                "prompt_eval_count": self.prompt_eval_count,
                "prompt_eval_duration": self.prompt_eval_duration_ns,
                "eval_count": self.eval_count,
                "eval_duration": self.eval_duration_ns,
            }
            | ({} if self.logprobs is None else {"logprobs": self.logprobs})
            | ({} if self.stop_sequence is None else {"stop_sequence": self.stop_sequence})
            | ({"prompt_cached_count": n} if (n := self.prompt_cached_count) else {})
        )


class StopMatcher:
    """Cuts streamed text at the first stop string, never emitting any part of it.

    Text that could be the beginning of a stop string is held back until the next piece
    shows whether it is one.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string found

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.held = ""
            return buf[:at], True
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
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self.bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else -1
        self._pieces: dict[int, tuple[bytes, bool]] = {}
        self._partial: PartialTokens | None = None

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
            cached = (self._bytes(token), bool(self._L.llama_vocab_is_eog(self.vocab, token)))
            self._pieces[token] = cached
        return cached

    def _bytes(self, token: int) -> bytes:
        L, buf = self._L, ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def partial(self) -> PartialTokens:
        """The tokens whose bytes are no whole UTF-8 text (byte tokens such as <0xC3>, a
        byte-level BPE's pieces of characters): read once, on first use (the whole
        vocabulary, 0.5 s for 262k tokens; a grammar job's sampler asks in the job's own
        thread, before the decode loop has it)."""
        if self._partial is None:
            by_first: dict[int, list[tuple[int, bytes]]] = {}
            cannot_begin = np.zeros(self.n_vocab, dtype=bool)
            for token in range(self.n_vocab):
                data = self._bytes(token)
                if not _utf8_prefix(data, final=True):
                    by_first.setdefault(data[0], []).append((token, data))
                    cannot_begin[token] = not _utf8_prefix(data)
            self._partial = PartialTokens(by_first, cannot_begin)
        return self._partial


@dataclass(frozen=True)
class PartialTokens:
    """A vocabulary's tokens that are not whole UTF-8 text, by their first byte, and the
    mask of those that cannot even begin a character."""

    by_first: dict[int, list[tuple[int, bytes]]]
    cannot_begin: np.ndarray


def _utf8_prefix(data: bytes, final: bool = False) -> bool:
    """Whether ``data`` is UTF-8 text (``final``), or the beginning of some."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=final)
    except UnicodeDecodeError:
        return False
    return _begins_a_character(decoder.getstate()[0])


# the second bytes a lead byte allows (Unicode's table 3-7; others: 80-BF), which the
# incremental decoder does not check before the character is whole
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _begins_a_character(tail: bytes) -> bool:
    """Whether ``tail`` (a character's first bytes, not all of them) can still be one."""
    if not tail:
        return True
    if not 0xC2 <= tail[0] <= 0xF4:
        return False
    low, high = _SECOND.get(tail[0], (0x80, 0xBF))
    return all((low <= b <= high) if n == 1 else 0x80 <= b <= 0xBF for n, b in enumerate(tail) if n)


class Utf8Guard:
    """Keeps a grammar's text valid UTF-8. llama.cpp's grammar reads a byte token (<0xE4>)
    as part of a character and lets through sequences no decoder accepts, so a JSON string
    could end up holding U+FFFD; this knows the bytes written so far that wait for the rest
    of their character, and which tokens may follow them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pending = b""  # the bytes of a character begun and not finished

    def fits(self, token: int) -> bool:
        piece, eog = self.tokenizer.piece(token)
        if eog:
            return not self.pending
        return _utf8_prefix(self.pending + piece)

    def accept(self, token: int) -> None:
        piece, _ = self.tokenizer.piece(token)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(self.pending + piece)
        self.pending = decoder.getstate()[0]

    def unfit(self) -> np.ndarray:
        """The tokens that cannot come next (a mask over the vocabulary): with no character
        begun, those that cannot begin one; else all but the continuations of the bytes
        begun (tokens whose first byte is a continuation byte, 80-BF)."""
        partial = self.tokenizer.partial()
        if not self.pending:
            return partial.cannot_begin
        unfit = np.ones(self.tokenizer.n_vocab, dtype=bool)
        for first in range(0x80, 0xC0):
            for token, data in partial.by_first.get(first, ()):
                if _utf8_prefix(self.pending + data):
                    unfit[token] = False
        return unfit

"""Sampling: a job's options as a llama.cpp sampler chain, and each step's next token.

:func:`sampler_plan` (pure, no llama.cpp) turns options into the chain's steps;
:class:`Sampler` builds that chain in llama.cpp, adds the grammar a ``format`` asks for
(:func:`grammar_for`), and takes plain greedy's argmax itself.
"""

from __future__ import annotations

import ctypes
import json
from functools import cache
from typing import Any

import numpy as np

from scheduler.errors import InvalidRequest
from scheduler.protocol import Options
from workers.engine.logprobs import token_logprobs
from workers.engine.text import Tokenizer, Utf8Guard

Format = str | dict[str, Any] | None

SamplerStep = tuple[Any, ...]


def sampler_plan(options: Options, num_ctx: int) -> list[SamplerStep]:
    """The llama.cpp sampler chain for ``options``, in llama.cpp's order.

    Penalties look up every candidate, which on a 262k vocabulary costs as much as the
    rest of sampling; when they can only lower logits, a wider top-k first keeps exactly
    the candidates that can still win (at most ``last_n`` tokens are penalized).
    """
    last_n = num_ctx if options.repeat_last_n == -1 else options.repeat_last_n
    greedy = options.temperature <= 0
    steps: list[SamplerStep] = []
    if last_n > 0 and _penalizes(options):
        keep = last_n + 1 if greedy else (options.top_k + last_n if options.top_k > 0 else 0)
        if keep and _only_lowers(options):
            steps.append(("top_k", keep))
        steps.append(
            (
                "penalties",
                last_n,
                options.repeat_penalty,
                options.frequency_penalty,
                options.presence_penalty,
            )
        )
    if options.top_logprobs is not None:  # not a sampler: what the job wants recorded
        steps.append(("logprobs", options.top_logprobs))
    if greedy:
        return [*steps, ("greedy",)]
    if options.top_k > 0:
        steps.append(("top_k", options.top_k))
    if options.top_p < 1.0:
        steps.append(("top_p", options.top_p))
    if options.min_p > 0.0:
        steps.append(("min_p", options.min_p))
    return [*steps, ("temp", options.temperature), ("dist", options.seed)]


def _penalizes(o: Options) -> bool:
    return o.repeat_penalty != 1.0 or o.frequency_penalty != 0.0 or o.presence_penalty != 0.0


def _only_lowers(o: Options) -> bool:
    return o.repeat_penalty >= 1.0 and o.frequency_penalty >= 0.0 and o.presence_penalty >= 0.0


def grammar_for(format: Format) -> str | None:
    """GBNF for ``format``: "json" (any JSON object) or a JSON schema."""
    if format is None:
        return None
    from llama_cpp import llama_grammar

    if format == "json":
        return str(llama_grammar.JSON_GBNF)
    if not isinstance(format, dict):
        raise InvalidRequest(f'format must be "json" or a JSON schema object (got {format!r})')
    _strict_strings()
    try:
        return str(llama_grammar.json_schema_to_gbnf(json.dumps(format)))
    except Exception as exc:
        raise InvalidRequest(
            f"format: this JSON schema cannot be turned into a grammar ({exc}); "
            "simplify the schema or use format='json'"
        ) from None


# a character of a JSON string as JSON has it (and llama.cpp's own converter writes it):
# no raw control character, no bare quote or backslash
_STRING_CHAR = r'[^"\\\x7F\x00-\x1F]'


@cache  # once: the converter's rules are the module's
def _strict_strings() -> None:
    """llama-cpp-python's schema converter lets a string's characters (its ``char`` rule)
    and a ``pattern``'s ``.`` be raw control characters, which JSON forbids (json.loads
    refuses them), and a pattern's ``.`` even a bare quote that ends the string: both are
    set to a JSON string's characters before converting (at the source, so a schema's own
    rule named ``char`` cannot dodge it)."""
    from llama_cpp import llama_grammar

    escapes = r'"\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
    llama_grammar.PRIMITIVE_RULES["char"] = llama_grammar.BuiltinRule(
        f"{_STRING_CHAR} | {escapes}", []
    )
    llama_grammar.DOT = _STRING_CHAR


# -- llama.cpp parts ----------------------------------------------------------------------


class GreedyRows:
    """The argmax of each of the last step's output rows, in one call: llama.cpp keeps the
    logits of the rows a batch asked for contiguously, in the batch's order.

    The numpy view of ``rows`` rows is made once per logits buffer and row count (llama.cpp
    moves the buffer only when it grows): making it at every step cost twice the argmax
    (33 us of a 2 ms step at 32 sequences of a tiny model, bench/step_split.py)."""

    def __init__(self, L: Any, ctx: Any, n_vocab: int) -> None:
        self._L, self._ctx, self._n_vocab = L, ctx, n_vocab
        self._at: int | None = None
        self._views: dict[int, np.ndarray] = {}  # by row count, over the buffer at _at

    def __call__(self, rows: int) -> list[int]:
        raw = self._L.llama_get_logits(self._ctx)
        at = ctypes.cast(raw, ctypes.c_void_p).value
        if at != self._at:
            self._at, self._views = at, {}
        view = self._views.get(rows)
        if view is None:
            view = self._views[rows] = np.ctypeslib.as_array(raw, shape=(rows, self._n_vocab))
        tokens: list[int] = view.argmax(axis=1).tolist()
        return tokens


class Sampler:
    """One sequence's llama.cpp sampler chain, and its grammar when ``format`` asks.

    Without a grammar, ``llama_sampler_sample`` does everything in C. A grammar checks
    every candidate piece, 25 ms a token on a 262k vocabulary, so it first judges only
    the token the chain picked and filters the whole vocabulary only when that token is
    not allowed (llama.cpp's own common sampler does the same).

    Plain greedy (no penalties, no grammar) is the logits' argmax, taken by numpy on the
    logits in place: ``llama_sampler_sample`` first copies the whole vocabulary into a
    candidate array, 0.28 ms a token on a 262k vocabulary against 0.035 ms, and the
    decode loop samples every sequence in turn while llama.cpp's threads wait. Both pick
    the first of equal maxima, so the tokens are the same.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        plan: list[SamplerStep],
        grammar: str | None,
        history: list[int],
    ) -> None:
        import llama_cpp as L

        self._L = L
        vocab, n_vocab = tokenizer.vocab, tokenizer.n_vocab
        self._n_vocab, self._tokenizer = n_vocab, tokenizer
        # the job's logprobs: recorded for each token sampled, not a step of the chain
        wanted = [step[1] for step in plan if step[0] == "logprobs"]
        self.top_logprobs: int | None = wanted[0] if wanted else None
        self.logprobs: list[dict[str, Any]] = []
        plan = [step for step in plan if step[0] != "logprobs"]
        self.utf8 = Utf8Guard(tokenizer) if grammar is not None else None
        if grammar is not None:
            tokenizer.partial()  # read once, here in the job's thread, not in the decode loop
        self.chain = self.grammar = None
        # plain greedy needs no chain: sample() takes the argmax itself, or llama.cpp does in
        # the decode graph (workers/engine/device_sampling.py)
        plain = plan == [("greedy",)] and grammar is None
        self.plain_greedy = plain and self.top_logprobs is None  # logprobs read the logits
        if not self.plain_greedy:
            params = L.llama_sampler_chain_default_params()
            params.no_perf = True
            self.chain = L.llama_sampler_chain_init(params)
            for step in plan:
                L.llama_sampler_chain_add(self.chain, _make_sampler(L, n_vocab, step))
            for token in history:  # penalties count the prompt too, as Ollama and llama.cpp do
                L.llama_sampler_accept(self.chain, token)
        if grammar is not None:
            self.grammar = L.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not self.grammar:
                self.free()
                raise InvalidRequest("format: llama.cpp rejected the grammar built from it")
            self._candidates = _Candidates(L, n_vocab)

    @property
    def chain_only(self) -> bool:
        """Its token is its chain's alone, no grammar and no logprobs: one
        ``llama_sampler_sample`` call, which a chain pool may make on another thread."""
        return self.chain is not None and self.grammar is None and self.top_logprobs is None

    def sample(self, ctx: Any, idx: int) -> int:
        if self.plain_greedy:
            logits = self._L.llama_get_logits_ith(ctx, idx)
            return int(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)).argmax())
        if self.grammar is None:
            token = int(self._L.llama_sampler_sample(self.chain, ctx, idx))
        else:
            token = self._sample_with_grammar(ctx, idx)
        if self.top_logprobs is not None:
            self._record(ctx, idx, token)
        return token

    def _record(self, ctx: Any, idx: int, token: int) -> None:
        """The sampled token's log probability (an end-of-generation token has none)."""
        piece, eog = self._tokenizer.piece(token)
        if eog:
            return
        raw = self._L.llama_get_logits_ith(ctx, idx)
        logits = np.ctypeslib.as_array(raw, shape=(self._n_vocab,))
        top = self.top_logprobs or 0
        self.logprobs.append(token_logprobs(logits, token, top, self._piece))

    def _piece(self, token: int) -> bytes:
        return self._tokenizer.piece(token)[0]

    def _sample_with_grammar(self, ctx: Any, idx: int) -> int:
        L, cand = self._L, self._candidates
        cand.fill(L.llama_get_logits_ith(ctx, idx))
        L.llama_sampler_apply(self.chain, cand.ref)
        token = cand.selected()
        utf8 = self.utf8
        assert utf8 is not None  # made with the grammar
        if not cand.allows(self.grammar, token) or not utf8.fits(token):
            cand.fill(L.llama_get_logits_ith(ctx, idx))
            logits = cand.data["logit"]
            logits[utf8.unfit()] = -np.inf
            if not np.isfinite(logits).any():  # cannot happen with all 256 byte tokens
                cand.fill(L.llama_get_logits_ith(ctx, idx))
            L.llama_sampler_apply(self.grammar, cand.ref)
            L.llama_sampler_apply(self.chain, cand.ref)
            token = cand.selected()
        L.llama_sampler_accept(self.grammar, token)
        L.llama_sampler_accept(self.chain, token)
        utf8.accept(token)
        return token

    def accept(self, token: int) -> None:
        """``token`` came next without being sampled here (a resumed job's answer so far):
        the grammar advances over it, and penalties count it."""
        if self.chain:
            self._L.llama_sampler_accept(self.chain, token)
        if self.grammar:
            self._L.llama_sampler_accept(self.grammar, token)
            assert self.utf8 is not None  # made with the grammar
            self.utf8.accept(token)

    def free(self) -> None:
        if self.chain:
            self._L.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            self._L.llama_sampler_free(self.grammar)
            self.grammar = None


class _Candidates:
    """A reusable llama_token_data_array over the whole vocabulary, filled from logits."""

    def __init__(self, L: Any, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self.data = np.zeros(n_vocab, dtype=dtype)
        self.data["id"] = np.arange(n_vocab, dtype=np.int32)
        self.array = L.llama_token_data_array(
            data=self.data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)),
            size=n_vocab,
            selected=-1,
            sorted=False,
        )
        self.ref = ctypes.byref(self.array)
        self._one = (L.llama_token_data * 1)()
        self._one_array = L.llama_token_data_array(
            data=self._one, size=1, selected=-1, sorted=False
        )
        self._L = L

    def fill(self, logits: Any) -> None:
        self.data["id"] = np.arange(self.n_vocab, dtype=np.int32)
        self.data["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        self.data["p"] = 0.0
        self.array.data = self.data.ctypes.data_as(ctypes.POINTER(self._L.llama_token_data))
        self.array.size = self.n_vocab
        self.array.selected = -1
        self.array.sorted = False

    def selected(self) -> int:
        return int(self.array.data[self.array.selected].id)

    def allows(self, grammar: Any, token: int) -> bool:
        self._one[0].id, self._one[0].logit, self._one[0].p = token, 1.0, 0.0
        self._one_array.size, self._one_array.selected = 1, -1
        self._L.llama_sampler_apply(grammar, ctypes.byref(self._one_array))
        return bool(self._one[0].logit != float("-inf"))


def _make_sampler(L: Any, n_vocab: int, step: SamplerStep) -> Any:
    kind, *args = step
    if kind == "greedy":
        return L.llama_sampler_init_greedy()
    if kind == "top_k":
        return L.llama_sampler_init_top_k(args[0])
    if kind == "top_p":
        return L.llama_sampler_init_top_p(args[0], 1)
    if kind == "min_p":
        return L.llama_sampler_init_min_p(args[0], 1)
    if kind == "temp":
        return L.llama_sampler_init_temp(args[0])
    if kind == "dist":
        return L.llama_sampler_init_dist(L.LLAMA_DEFAULT_SEED if args[0] < 0 else args[0])
    if kind == "penalties":
        return L.llama_sampler_init_penalties(n_vocab, *args)
    raise ValueError(f"unknown sampler step {step!r}")


def _penalty_history(plan: list[SamplerStep], tokens: list[int]) -> list[int]:
    """The prompt tokens the penalties sampler should have seen (its window)."""
    for step in plan:
        if step[0] == "penalties":
            return tokens[-step[1] :]
    return []

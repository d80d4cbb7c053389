"""Continuous batching: one llama.cpp model and context serving several jobs at once.

One decode loop thread owns the context. Each step it admits waiting jobs into free
sequence slots (arrival order), fills one ``llama_batch`` with the next token of every
running sequence and as many prompt tokens of newly admitted ones as ``n_batch`` leaves
room for, calls ``llama_decode`` once, and samples one token per sequence whose logits
the step produced. Sequences retire as they finish and their slots go to the next job.
The batch is laid out so that llama.cpp's split into micro-batches (one pass over the
weights each) stays at one for running sequences and adds at most an output-less one for
a joining prompt (:func:`batch_rows`, :func:`prompt_take`).

Callers (one thread per job) prepare their job in their own thread (tokenizing, building
the sampler chain, parsing a grammar), hand it to the loop and block until it ends.
``on_text`` is called from the decode thread: it must be cheap and must not block.
``cancelled`` is polled at the start of every step, so a cancelled job leaves its slot
before the next decode; one cancelled while waiting never starts.

The pure parts (stop strings, UTF-8 buffering, token budget, sampler plan, admission and
slots) import no llama.cpp and are tested on their own.
"""

from __future__ import annotations

import codecs
import ctypes
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from scheduler.errors import GgufqError, InvalidRequest, JobFailed, LoadFailed
from scheduler.gguf.estimate import RunnerConfig
from scheduler.protocol import Options
from workers.cpus import default_thread_counts, llama
from workers.loadwatch import LoadWatch

log = logging.getLogger(__name__)

# ggml type ids of the KV cache types (ggml.h: GGML_TYPE_F32 = 0, F16 = 1, Q4_0 = 2, ...)
GGML_KV_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}

# llama_decode's return codes (llama.h)
DECODE_ERRORS = {
    1: "no room in the KV cache for the batch",
    2: "decoding was aborted",
    -1: "the batch was invalid",
}

Format = str | dict[str, Any] | None


@dataclass
class GenerationStats:
    text: str
    done_reason: str
    prompt_eval_count: int
    prompt_eval_duration_ns: int
    eval_count: int
    eval_duration_ns: int

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


# -- pure parts ---------------------------------------------------------------------------


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


T = TypeVar("T")


class Admission(Generic[T]):
    """Jobs waiting for a slot, in arrival order, and the free sequence ids."""

    def __init__(self, n_slots: int) -> None:
        self.waiting: deque[T] = deque()
        self.free = list(range(n_slots))

    def push(self, job: T) -> None:
        self.waiting.append(job)

    def take_cancelled(self, is_cancelled: Callable[[T], bool]) -> list[T]:
        gone = [job for job in self.waiting if is_cancelled(job)]
        for job in gone:
            self.waiting.remove(job)
        return gone

    def admit(self, reuse: Callable[[T, int], int] | None = None) -> list[tuple[T, int]]:
        """Waiting jobs paired with the free slots they take, first come first served;
        each takes the free slot where ``reuse(job, slot)`` (cached prompt tokens it can
        reuse there) is largest, the lowest slot on a tie."""
        admitted = []
        while self.waiting and self.free:
            job = self.waiting.popleft()
            slot = max(self.free, key=lambda s: (reuse(job, s) if reuse else 0, -s))
            self.free.remove(slot)
            admitted.append((job, slot))
        return admitted

    def release(self, seq: int) -> None:
        self.free.append(seq)
        self.free.sort()

    def drain(self) -> list[T]:
        jobs = list(self.waiting)
        self.waiting.clear()
        return jobs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Feed:
    """What one sequence puts into a decode step: ``tokens`` from position ``pos`` on, and
    whether the last of them needs logits."""

    seq: int
    tokens: list[int]
    pos: int
    output: bool


def prompt_take(left: int, room: int, others_decode: bool) -> tuple[int, bool]:
    """How many of a prompt's ``left`` tokens go into this step (``room`` is what the
    batch has left), and whether the last of them gets logits.

    While other sequences decode, a prompt's last token waits for the next step, where it
    rides in the one-token-per-sequence micro-batch with theirs: the rest of the prompt
    then needs no logits, and llama.cpp evaluates its micro-batch without the output
    layer (for a 262k vocabulary, most of a step's weights)."""
    take = min(left, room)
    if take < left:
        return take, False
    if others_decode and left >= 2:
        return left - 1, False
    return take, True


def batch_rows(feeds: list[Feed]) -> list[tuple[int, int, int, int, bool]]:
    """The rows of one ``llama_batch``, (feed index, token, pos, seq, logits): the first
    token of every feed in sequence order, then the rest of each feed.

    With one KV stream per sequence llama.cpp splits a batch into micro-batches of
    consecutive sequence ids with equal token counts (``split_equal``), each a pass over
    all weights. Listing each sequence's first token in id order keeps sequences in
    adjacent slots in the first micro-batch; a joining sequence listed after the others
    would split the running ones around its id into two. (A free slot between running
    ones still splits them: ids 0, 1, 3 make {0, 1} and {3}.)"""
    order = sorted(range(len(feeds)), key=lambda i: feeds[i].seq)
    rows = []
    for i in order:
        f = feeds[i]
        rows.append((i, f.tokens[0], f.pos, f.seq, f.output and len(f.tokens) == 1))
    for i in order:
        f = feeds[i]
        last = len(f.tokens) - 1
        for k in range(1, len(f.tokens)):
            rows.append((i, f.tokens[k], f.pos + k, f.seq, f.output and k == last))
    return rows


def grammar_for(format: Format) -> str | None:
    """GBNF for ``format``: "json" (any JSON object) or a JSON schema."""
    if format is None:
        return None
    from llama_cpp import llama_grammar

    if format == "json":
        return llama_grammar.JSON_GBNF
    if not isinstance(format, dict):
        raise InvalidRequest(f'format must be "json" or a JSON schema object (got {format!r})')
    try:
        return llama_grammar.json_schema_to_gbnf(json.dumps(format))
    except Exception as exc:
        raise InvalidRequest(
            f"format: this JSON schema cannot be turned into a grammar ({exc}); "
            "simplify the schema or use format='json'"
        ) from None


# -- llama.cpp parts ----------------------------------------------------------------------


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
        vocab: Any,
        n_vocab: int,
        plan: list[SamplerStep],
        grammar: str | None,
        history: list[int],
    ) -> None:
        import llama_cpp as L

        self._L = L
        self._n_vocab = n_vocab
        self.chain = self.grammar = None
        # plain greedy needs no chain: sample() takes the argmax itself
        self._argmax = plan == [("greedy",)] and grammar is None
        if not self._argmax:
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

    def sample(self, ctx: Any, idx: int) -> int:
        if self._argmax:
            logits = self._L.llama_get_logits_ith(ctx, idx)
            return int(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)).argmax())
        if self.grammar is None:
            return int(self._L.llama_sampler_sample(self.chain, ctx, idx))
        return self._sample_with_grammar(ctx, idx)

    def _sample_with_grammar(self, ctx: Any, idx: int) -> int:
        L, cand = self._L, self._candidates
        cand.fill(L.llama_get_logits_ith(ctx, idx))
        L.llama_sampler_apply(self.chain, cand.ref)
        token = cand.selected()
        if not cand.allows(self.grammar, token):
            cand.fill(L.llama_get_logits_ith(ctx, idx))
            L.llama_sampler_apply(self.grammar, cand.ref)
            L.llama_sampler_apply(self.chain, cand.ref)
            token = cand.selected()
        L.llama_sampler_accept(self.grammar, token)
        L.llama_sampler_accept(self.chain, token)
        return token

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


@dataclass(eq=False)
class Job:
    """One generation: what it asked for, where it stands, and how it ended."""

    tokens: list[int]
    budget: int
    sampler: Sampler
    on_text: Callable[[str], None]
    cancelled: Callable[[], bool]
    stops: StopMatcher
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    done: threading.Event = field(default_factory=threading.Event)
    seq: int = -1
    fed: int = 0  # prompt tokens already sent to llama_decode (or found in the slot's cache)
    decoded: list[int] = field(default_factory=list)  # tokens whose KV is in the slot
    pos: int = 0  # position of the next token in the sequence
    next_token: int = -1  # sampled, not yet decoded
    generated: int = 0
    parts: list[str] = field(default_factory=list)
    admitted_ns: int = 0
    first_ns: int = 0
    stats: GenerationStats | None = None
    error: GgufqError | None = None

    def emit(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.on_text(text)


@dataclass(frozen=True)
class ContextSize:
    """The llama.cpp context a runner's configuration asks for (as the estimator sizes it)."""

    n_ctx: int
    n_seq_max: int
    n_batch: int
    n_ubatch: int
    n_outputs_max: int

    @classmethod
    def of(cls, config: RunnerConfig) -> ContextSize:
        n_ctx = config.num_ctx * config.num_parallel
        n_batch = min(config.n_batch, n_ctx)  # as llama-cpp-python clamps, and the estimate
        # a step asks for at most one row of logits per sequence: fewer rows would fail it
        outputs = max(config.n_outputs, config.num_parallel) if config.n_outputs else 0
        return cls(n_ctx, config.num_parallel, n_batch, min(config.n_ubatch, n_batch), outputs)


_backend_ready = threading.Lock()
_backend_done = False


def _init_backend(L: Any) -> None:
    global _backend_done
    with _backend_ready:
        if not _backend_done:
            # as Llama(verbose=False): llama.cpp's info lines are noise in a worker's log
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
            L.llama_backend_init()
            _backend_done = True


class Engine:
    """A loaded model and context, and the decode loop that serves jobs on it."""

    def __init__(
        self,
        path: str,
        config: RunnerConfig,
        *,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        name: str = "",
        load_timeout_s: float = 300.0,
        split: list[float] | None = None,
    ) -> None:
        L = llama()
        _init_backend(L)
        self._L = L
        self.name = name or os.path.basename(path)
        self.config = config
        self.size = ContextSize.of(config)
        watch = LoadWatch(load_timeout_s)
        self.model, self.ctx = _load(
            L, path, config, self.size, n_gpu_layers, n_threads, watch, split
        )
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._bos = L.llama_vocab_bos(self.vocab) if L.llama_vocab_get_add_bos(self.vocab) else -1
        self._mem = L.llama_get_memory(self.ctx)
        self._cached: dict[int, list[int]] = {}  # slot → tokens whose KV it still holds
        self._n_swa = L.llama_model_n_swa(self.model)
        self.reused_tokens = 0  # prompt tokens not evaluated again, thanks to the slot caches
        self._batch = L.llama_batch_init(self.size.n_batch, 0, 1)
        for i in range(self.size.n_batch):
            self._batch.n_seq_id[i] = 1
        self._tokens, self._pos = self._batch.token, self._batch.pos
        self._seq_ids, self._logits = self._batch.seq_id, self._batch.logits
        self._pieces: dict[int, tuple[bytes, bool]] = {}
        self._admission: Admission[Job] = Admission(config.num_parallel)
        self._active: list[Job] = []
        self._cond = threading.Condition()
        self._prep = threading.Lock()  # held while a caller uses the model outside the loop
        self._closing = False
        self._step_no = 0
        self._thread = threading.Thread(target=self._run, name=f"decode-{self.name}", daemon=True)
        self._thread.start()

    # -- callers' side --------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool] = lambda: False,
        format: Format = None,
    ) -> GenerationStats:
        """Run one job to its end (blocking); raises JobFailed, InvalidRequest."""
        grammar = grammar_for(format)
        with self._prep:  # close() waits for this: the model stays alive while in use here
            job = self._prepare(prompt, options, on_text, cancelled, grammar)
            if job.budget <= 0:
                job.sampler.free()
                return GenerationStats("", "length", len(job.tokens), 0, 0, 0)
            self._submit(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.stats is not None
        return job.stats

    def _prepare(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool],
        grammar: str | None,
    ) -> Job:
        self._check_open()
        tokens = self.tokenize(prompt)
        num_ctx = self.config.num_ctx
        if len(tokens) >= num_ctx:
            raise InvalidRequest(
                f"prompt is {len(tokens)} tokens but a slot of {self.name!r} holds "
                f"{num_ctx} (options.num_ctx), leaving no room to generate; "
                "shorten the prompt or raise options.num_ctx"
            )
        plan = sampler_plan(options, num_ctx)
        sampler = Sampler(self.vocab, self.n_vocab, plan, grammar, _penalty_history(plan, tokens))
        return Job(
            tokens=tokens,
            budget=token_budget(options.num_predict, num_ctx, len(tokens)),
            sampler=sampler,
            on_text=on_text,
            cancelled=cancelled,
            stops=StopMatcher(options.stop),
        )

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
        if self._bos >= 0:
            tokens.insert(0, self._bos)
        if not tokens:
            raise InvalidRequest("the prompt is empty; give at least one character")
        return tokens

    def _submit(self, job: Job) -> None:
        with self._cond:
            self._admission.push(job)
            self._cond.notify()

    def _check_open(self) -> None:
        if self._closing:
            raise JobFailed(
                f"the runner of {self.name!r} is unloading and takes no more jobs; "
                "submit the job again"
            )

    def close(self) -> None:
        """Stop the loop, end running and waiting jobs with JobFailed, free llama.cpp."""
        with self._prep:
            with self._cond:
                if self._closing:
                    return
                self._closing = True
                self._cond.notify()
            self._thread.join()
            L = self._L
            L.llama_batch_free(self._batch)
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)

    # -- the decode loop ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._active or self._admission.waiting or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                gone = self._admission.take_cancelled(_is_cancelled)
                admitted = self._admission.admit(self._reusable)
            now = time.perf_counter_ns()
            for job in gone:
                job.admitted_ns = now
                self._end(job, "cancel", now)
            for job, seq in admitted:
                job.seq, job.admitted_ns = seq, now
                self._reuse_prefix(job)
                self._active.append(job)
            try:
                self._step()
            except Exception as exc:  # a bug here must fail jobs, never hang them
                log.exception("decode step failed on %s", self.name)
                for job in list(self._active):
                    self._fail(job, f"the decode loop failed ({exc!r})")
        self._shutdown()

    def _step(self) -> None:
        now = time.perf_counter_ns()
        for job in [j for j in self._active if _is_cancelled(j)]:
            self._end(job, "cancel", now)
        outputs, in_batch, n = self._fill_batch()
        if n == 0:
            return
        self._batch.n_tokens = n
        rc = self._L.llama_decode(self.ctx, self._batch)
        if rc != 0:
            self._decode_failed(rc, n, in_batch)
            return
        now = time.perf_counter_ns()
        # sample every sequence before publishing any text: each ctypes call and numpy's
        # argmax lets go of the GIL, and a chunk handed over mid-loop wakes the chunk
        # writer, which then holds the GIL while llama.cpp's threads wait for this loop
        sampled = [job.sampler.sample(self.ctx, idx) for job, idx in outputs]
        for (job, _idx), token in zip(outputs, sampled, strict=True):
            self._advance(job, token, now)

    def _fill_batch(self) -> tuple[list[tuple[Job, int]], list[Job], int]:
        """The next token of every running sequence, then prompt tokens as :func:`prompt_take`
        allows in the room n_batch leaves, laid out by :func:`batch_rows`."""
        decoding = self._decoding(self.size.n_batch)
        feeds = [(job, Feed(job.seq, [job.next_token], job.pos, True)) for job in decoding]
        room = self.size.n_batch - len(decoding)
        for job in self._active:
            left = len(job.tokens) - job.fed
            if left <= 0 or room <= 0:
                continue
            take, output = prompt_take(left, room, bool(decoding))
            chunk = job.tokens[job.fed : job.fed + take]
            feeds.append((job, Feed(job.seq, chunk, job.fed, output)))
            room -= take
        tokens, pos, seq_ids, logits = self._tokens, self._pos, self._seq_ids, self._logits
        outputs: list[tuple[Job, int]] = []
        rows = batch_rows([feed for _, feed in feeds])
        for n, (i, token, position, seq, output) in enumerate(rows):
            tokens[n], pos[n], seq_ids[n][0], logits[n] = token, position, seq, output
            if output:
                outputs.append((feeds[i][0], n))
        for job, feed in feeds:
            job.decoded += feed.tokens
            if job.next_token >= 0:
                job.pos += 1
                job.next_token = -1
            else:
                job.fed += len(feed.tokens)
                job.pos = job.fed
        return outputs, [job for job, _ in feeds], len(rows)

    def _decoding(self, limit: int) -> list[Job]:
        """Sequences with a token to decode, in slot order: llama.cpp reuses the previous
        step's graph only for the same layout (a rotating order made steps 1.5x slower)."""
        ready = sorted((j for j in self._active if j.next_token >= 0), key=lambda j: j.seq)
        if len(ready) > limit:  # n_batch below num_parallel: take turns
            self._step_no += 1
            start = self._step_no % len(ready)
            ready = sorted((ready[start:] + ready[:start])[:limit], key=lambda j: j.seq)
        return ready

    def _advance(self, job: Job, token: int, now: int) -> None:
        job.generated += 1
        if not job.first_ns:
            job.first_ns = now
        piece, eog = self._piece(token)
        if eog:
            self._end(job, "stop", now)
            return
        text, stopped = job.stops.feed(job.utf8.feed(piece))
        try:
            job.emit(text)
        except Exception as exc:
            self._fail(job, f"the consumer of its text failed ({exc!r})")
            return
        if stopped:
            self._end(job, "stop", now, flush=False)
        elif job.generated >= job.budget:
            self._end(job, "length", now)
        else:
            job.next_token = token

    def _piece(self, token: int) -> tuple[bytes, bool]:
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

    def _end(self, job: Job, reason: str, now: int, flush: bool = True) -> None:
        if flush and reason != "cancel":
            try:
                tail, _ = job.stops.feed(job.utf8.flush())
                job.emit(tail + job.stops.flush())
            except Exception as exc:
                self._fail(job, f"the consumer of its text failed ({exc!r})")
                return
        first = job.first_ns or now
        job.stats = GenerationStats(
            text="".join(job.parts),
            done_reason=reason,
            prompt_eval_count=len(job.tokens),
            prompt_eval_duration_ns=first - job.admitted_ns if job.generated else 0,
            eval_count=job.generated,
            eval_duration_ns=now - first,
        )
        self._retire(job)

    def _fail(self, job: Job, why: str) -> None:
        job.error = JobFailed(
            f"job on {self.name!r} failed after {job.generated} generated tokens: {why}; "
            "submit it again"
        )
        self._retire(job, keep=False)  # its KV may be half written

    def _reusable(self, job: Job, seq: int) -> int:
        """Prompt tokens of ``job`` already in slot ``seq``'s cache (the last one is always
        evaluated again: its logits start the answer)."""
        return min(common_prefix(self._cached.get(seq, []), job.tokens), len(job.tokens) - 1)

    def _reuse_prefix(self, job: Job) -> None:
        """Drop the slot's cache after the part ``job`` shares with it; skip that part."""
        L, seq = self._L, job.seq
        keep = self._reusable(job, seq)
        if keep > 0 and L.llama_memory_seq_rm(self._mem, seq, keep, -1):
            # a sliding-window cache may have dropped what the next tokens attend to
            lowest = L.llama_memory_seq_pos_min(self._mem, seq)
            if self._n_swa == 0 or lowest <= max(0, keep - self._n_swa):
                job.fed = job.pos = keep
                job.decoded = job.tokens[:keep]
                self.reused_tokens += keep
                return
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def _retire(self, job: Job, keep: bool = True) -> None:
        if job.seq >= 0:
            # the slot keeps its KV cache: a later prompt that starts the same (a system
            # prompt, a conversation so far) skips evaluating that part again
            self._cached[job.seq] = job.decoded if keep else []
            if not keep:
                self._L.llama_memory_seq_rm(self._mem, job.seq, -1, -1)
            with self._cond:
                self._admission.release(job.seq)
            job.seq = -1
        if job in self._active:
            self._active.remove(job)
        job.sampler.free()
        job.done.set()

    def _decode_failed(self, rc: int, n: int, jobs: list[Job]) -> None:
        meaning = DECODE_ERRORS.get(rc, "fatal error in llama.cpp")
        why = f"llama_decode returned {rc} ({meaning}) for a batch of {n} tokens"
        log.error("%s on %s; failing %d jobs", why, self.name, len(jobs))
        for job in jobs:
            self._fail(job, why)

    def _shutdown(self) -> None:
        with self._cond:
            waiting = self._admission.drain()
        for job in [*self._active, *waiting]:
            self._fail(job, f"the runner of {self.name!r} was unloaded")


def _is_cancelled(job: Job) -> bool:
    try:
        return bool(job.cancelled())
    except Exception:
        log.exception("cancelled() raised; cancelling the job")
        return True


def _penalty_history(plan: list[SamplerStep], tokens: list[int]) -> list[int]:
    """The prompt tokens the penalties sampler should have seen (its window)."""
    for step in plan:
        if step[0] == "penalties":
            return tokens[-step[1] :]
    return []


def _load(
    L: Any,
    path: str,
    config: RunnerConfig,
    size: ContextSize,
    n_gpu_layers: int,
    n_threads: int | None,
    watch: LoadWatch,
    split: list[float] | None = None,
) -> tuple[Any, Any]:
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    shares = None
    if split:  # layers over several GPUs, as placement split them (workers.devices)
        shares = (ctypes.c_float * L.llama_max_devices())(*split)
        mparams.tensor_split = shares
        mparams.main_gpu = next(i for i, share in enumerate(split) if share > 0)
    on_progress = L.llama_progress_callback(lambda fraction, _data: watch.progress(fraction))
    mparams.progress_callback = on_progress  # kept referenced until the load returns
    model = L.llama_model_load_from_file(path.encode(), mparams)
    del shares  # llama.cpp copied the split while loading
    if not model:
        if watch.stalled_s:
            raise LoadFailed(f"gave up loading {path}: {watch.describe()}")
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = size.n_ctx
    cparams.n_seq_max = size.n_seq_max
    cparams.n_batch = size.n_batch
    cparams.n_ubatch = size.n_ubatch
    cparams.n_outputs_max = size.n_outputs_max
    cparams.kv_unified = False  # one KV stream per sequence, as the estimate assumes
    cparams.flash_attn_type = (
        L.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    cparams.swa_full = config.swa_full
    cparams.type_k = cparams.type_v = GGML_KV_TYPES[config.kv_type]
    one_token, batch = default_thread_counts()  # a thread per physical core, per CPU
    cparams.n_threads = n_threads or one_token
    cparams.n_threads_batch = n_threads or batch
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError(
            f"llama.cpp could not create a context of {size.n_ctx} tokens for {path}"
        )
    return model, ctx

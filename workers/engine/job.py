"""One job's state in the decode loop (:class:`Job`), and the account of the loop's time
(:class:`StepTimes`: llama_decode, sampling, the hand-over to the text relay and the rest, for
``bench/step_split.py`` and whoever asks ``Engine.times``). Pure: no llama.cpp."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from scheduler.errors import GgufqError, JobFailed
from workers.engine.sampling import Sampler
from workers.engine.text import GenerationStats, StopMatcher, Utf8Stream

Share = tuple[str, str, float]  # whom a job is for: tenant, priority, weight

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """The decode loop's time, summed over its steps (nanoseconds of perf_counter_ns).

    A step runs from the loop's wake-up to the end of its batch: ``decode_ns`` is
    llama_decode and the wait for its result (a GPU computes asynchronously),
    ``sample_ns`` picking every sequence's next token, ``emit_ns`` handing the step's
    tokens to the text relay, and :attr:`bookkeeping_ns` the rest: admission,
    cancellation checks, the batch layout, each token's piece, retiring jobs. ``relay_ns``
    is not a step's: it is the text relay's own thread (workers/engine/relay.py) making
    the jobs' text (characters, stop strings, ``on_text``: the stream writes) while the
    next steps decode. Each field has one thread that adds to it: plain ints, no
    allocation per token."""

    steps: int = 0
    tokens: int = 0  # tokens sampled
    step_ns: int = 0
    decode_ns: int = 0
    sample_ns: int = 0
    emit_ns: int = 0
    relay_ns: int = 0  # the text relay's thread, beside the steps

    @property
    def bookkeeping_ns(self) -> int:
        return self.step_ns - self.decode_ns - self.sample_ns - self.emit_ns

    def since(self, earlier: StepTimes) -> StepTimes:
        """What was added after ``earlier`` (a copy taken then with :meth:`copy`)."""
        return StepTimes(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def copy(self) -> StepTimes:
        return replace(self)


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
    cached: int = 0  # prompt tokens found in the slot's cache (not evaluated again)
    decoded: list[int] = field(default_factory=list)  # tokens whose KV is in the slot
    pos: int = 0  # position of the next token in the sequence
    next_token: int = -1  # sampled, not yet decoded
    on_device: bool = False  # its tokens are sampled in llama_decode (device_sampling.py)
    generated: int = 0
    # set by the text relay: a stop string was found, or its on_text failed (error); the
    # loop retires it at its next step. stop_at: its tokens up to the stop string's
    halted: bool = False
    stop_at: int = 0
    stop_ns: int = 0  # when the token that ended it in a stop string was decoded
    # the answer's token ids, each appended by the text relay with its text (the job's chunks
    # carry them; none after a stop string);
    # a resumed job's first ``forced`` are those of its answer so far, evaluated with its
    # prompt (at the end of ``tokens``) and replayed through its text (:meth:`replay`)
    out: list[int] = field(default_factory=list)
    forced: int = 0
    parts: list[str] = field(default_factory=list)
    admitted_ns: int = 0
    first_ns: int = 0
    share: Share = ("default", "interactive", 1.0)  # whom it is for: its turn among waiters
    stats: GenerationStats | None = None
    error: GgufqError | None = None

    def emit(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.on_text(text)

    def replay(self, piece: Callable[[int], tuple[bytes, bool]]) -> str | None:
        """Feed a resumed job's answer so far through its sampler (grammar, penalties) and
        its text (characters, stop strings, ``on_text``) as if just sampled, so that what
        comes next continues it; the publisher drops the text its stream holds already.
        Why it ended among those tokens, if it did ("stop", "length"), else None."""
        for token in self.out[: self.forced]:
            self.sampler.accept(token)
            data, eog = piece(token)
            if eog:
                return "stop"
            text, stopped = self.stops.feed(self.utf8.feed(data))
            self.emit(text)
            if stopped:
                return "stop"
        if self.generated >= self.budget:
            self.emit(self.tail())
            return "length"
        return None

    def tail(self) -> str:
        """The text held back at the end of a generation that met no stop string: a
        character begun, and what could have begun a stop string."""
        rest, _ = self.stops.feed(self.utf8.flush())
        return rest + self.stops.flush()

    def failure(self, runner: str, why: str) -> JobFailed:
        """The error of this job failing on ``runner`` for ``why``."""
        return JobFailed(
            f"job on {runner!r} failed after {self.generated} generated tokens: {why}; "
            "submit it again"
        )

    def finished(self, reason: str, now: int) -> GenerationStats:
        """Its account, ending now (perf_counter_ns) for ``reason``."""
        first = self.first_ns or now
        wanted = self.sampler.top_logprobs is not None
        return GenerationStats(
            text="".join(self.parts),
            done_reason=reason,
            prompt_eval_count=len(self.tokens) - self.forced,
            prompt_cached_count=self.cached,
            prompt_eval_duration_ns=first - self.admitted_ns if self.first_ns else 0,
            eval_count=self.generated,
            eval_duration_ns=now - first,
            admitted_ns=self.admitted_ns,
            logprobs=self.sampler.logprobs if wanted else None,
            stop_sequence=self.stops.matched,
        )


def always() -> bool:
    """The ``cancelled`` of a job that must end at its next step."""
    return True


def is_cancelled(job: Job) -> bool:
    """Whether ``job`` is cancelled; a ``cancelled`` that raises cancels it."""
    try:
        return bool(job.cancelled())
    except Exception:
        log.exception("cancelled() raised; cancelling the job")
        return True

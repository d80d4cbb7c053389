"""Continuous batching: one llama.cpp model and context serving several jobs at once.

One decode loop thread owns the context. Each step it admits waiting jobs into free
sequence slots (arrival order), fills one ``llama_batch`` with the next token of every
running sequence and as many prompt tokens of newly admitted ones as ``n_batch`` leaves
room for, calls ``llama_decode`` once, and samples one token per sequence whose logits
the step produced. Sequences retire as they finish and their slots go to the next job.
The batch is laid out so that llama.cpp's split into micro-batches (one pass over the
weights each) stays at one for running sequences and adds at most an output-less one for
a joining prompt (:mod:`workers.engine.layout`).

Callers (one thread per job) prepare their job in their own thread (tokenizing, building
the sampler chain, parsing a grammar), hand it to the loop and block until it ends.
Each step's tokens become text on the engine's text relay thread
(:mod:`workers.engine.relay`), while the next step decodes: ``on_text`` is called there,
and must be cheap and must not block.
``cancelled`` is polled at the start of every step, so a cancelled job leaves its slot
before the next decode; one cancelled while waiting never starts.

This module owns the loop (:class:`Engine`); a job's state and the loop's time are
:mod:`workers.engine.job`'s, the parts it drives its siblings' (:mod:`workers.engine`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from scheduler.errors import JobFailed
from scheduler.protocol import Options, RunnerConfig
from workers.cpus import llama
from workers.engine.batching import Admission, best_slot, reusable
from workers.engine.chains import ChainPool
from workers.engine.device_sampling import DeviceGreedy
from workers.engine.gil import KeepsGil, keeping_gil
from workers.engine.job import Job, Share, StepTimes, always, is_cancelled
from workers.engine.layout import Layout
from workers.engine.load import DECODE_ERRORS, ContextSize, _init_backend, _load
from workers.engine.prepare import new_job
from workers.engine.relay import TextRelay
from workers.engine.sampling import Format, GreedyRows, grammar_for
from workers.engine.text import GenerationStats, Tokenizer
from workers.loadwatch import LoadWatch

log = logging.getLogger(__name__)


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
        device_sampling: bool = False,
        on_load: Callable[[float], None] | None = None,  # the load's fraction done
        keep_gil: bool | None = None,  # None: where every layer is on a GPU (gil.py)
        chain_threads: int | None = None,  # None: as chains.ChainPool decides
    ) -> None:
        L = llama()
        _init_backend(L)
        self.name = name or os.path.basename(path)
        self.config = config
        self.size = size = ContextSize.of(config)
        watch = LoadWatch(load_timeout_s, report=on_load)
        self.model, self.ctx = _load(L, path, config, size, n_gpu_layers, n_threads, watch, split)
        layers = L.llama_model_n_layer(self.model)
        L = self._L = keeping_gil(L, n_gpu_layers < 0 or n_gpu_layers >= layers, keep_gil)
        self.keeps_gil = isinstance(L, KeepsGil)  # its short calls between decodes
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._mem = L.llama_get_memory(self.ctx)
        self._device = DeviceGreedy(L, self.ctx, device_sampling)  # greedy's argmax
        self._greedy = GreedyRows(L, self.ctx, self.n_vocab)  # or numpy's, on the host
        self._chains = ChainPool(L, self.ctx, self.n_vocab, chain_threads, n_threads)
        self._cached: dict[int, list[int]] = {}  # slot → tokens whose KV it still holds
        self._n_swa = L.llama_model_n_swa(self.model)
        self.reused_tokens = 0  # prompt tokens not evaluated again, thanks to the slot caches
        self._batch = L.llama_batch_init(self.size.n_batch, 0, 1)
        for i in range(self.size.n_batch):
            self._batch.n_seq_id[i] = 1
        self._layout = Layout(self._batch, self.size.n_batch)  # each step's rows
        self._tokenizer = Tokenizer(L, self.vocab)
        self._admission: Admission[Job] = Admission(config.num_parallel, lambda job: job.share)
        self._active: list[Job] = []
        self._own_sampling: set[Job] = set()  # active jobs not sampled by the host's argmax
        self._cond = threading.Condition()
        self._prep = threading.Lock()  # held while a caller uses the model outside the loop
        self._closing = False  # no job comes in: closed, or the loop ended
        self._closed = False
        self.stopped: str | None = None  # why the loop stopped on a bug: its runner is done
        self.times = StepTimes()
        self._relay = TextRelay(self.name, self.times)
        self._outbox: list[Any] = []  # this step's tokens and ends, for the relay
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
        share: Share = ("default", "interactive", 1.0),
        meanwhile: Callable[[], None] = lambda: None,
        answer: list[int] | None = None,
    ) -> GenerationStats:
        """Run one job to its end (blocking); raises JobFailed, InvalidRequest. ``answer``:
        the list each sampled token is appended to (with its text), holding a resumed job's
        answer so far (:func:`workers.engine.prepare.new_job`). Waiting jobs take free slots
        in fair order of their ``share`` (scheduler/fairness.py).
        ``meanwhile()`` runs in the caller's thread once the job is queued, while its first
        step may already run; if it raises, the job is cancelled, and the error raised
        once the job has ended."""
        grammar = grammar_for(format)
        with self._prep:  # close() waits for this: the model stays alive while in use here
            self._check_open()
            num_ctx, piece = self.config.num_ctx, self._tokenizer.piece
            args = (prompt, options, on_text, cancelled, grammar, answer)
            job = new_job(self._tokenizer, self.name, num_ctx, *args)
            job.share = share
            try:
                if job.forced:  # resumed: its answer so far is replayed first
                    ended = job.replay(piece)
                else:
                    ended = None if job.budget > 0 else "length"
                queued = ended is None
                if queued:
                    self._submit(job)
            except BaseException:
                job.sampler.free()
                raise
            if not queued:
                job.sampler.free()
        try:
            meanwhile()
        except BaseException:
            if queued:
                job.cancelled = always  # it ends at its next step
                job.done.wait()
            raise
        if ended is not None:
            return job.finished(ended, time.perf_counter_ns())
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.stats is not None
        return job.stats

    def tokenize(self, text: str) -> list[int]:
        """The prompt's tokens (:meth:`workers.engine.text.Tokenizer.tokenize`)."""
        return self._tokenizer.tokenize(text)

    def _submit(self, job: Job) -> None:
        with self._cond:
            self._check_open()  # again: a loop that stopped on a bug drained its queue
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
                if self._closed:
                    return
                self._closed = self._closing = True
                self._cond.notify()
            self._thread.join()
            self._relay.close()  # every job's text made and its done set
            self._chains.close()
            L = self._L
            L.llama_batch_free(self._batch)
            L.llama_free(self.ctx)
            self._device.free()
            L.llama_model_free(self.model)

    # -- the decode loop ------------------------------------------------------------------
    def _run(self) -> None:
        why = f"the runner of {self.name!r} was unloaded"
        try:
            self._steps()
        except BaseException as exc:  # a bug: told, and no job is left waiting on the loop
            log.exception("the decode loop of %s stopped", self.name)
            why = f"the decode loop of {self.name!r} stopped ({exc!r})"
            self.stopped = why
        finally:  # and none comes in
            with self._cond:
                self._closing = True
            try:
                self._shutdown(why)
            finally:
                self._hand_over()

    def _steps(self) -> None:
        times = self.times
        while True:
            with self._cond:
                while not (self._active or self._admission.waiting or self._closing):
                    self._cond.wait()
                started = time.perf_counter_ns()
                if self._closing:
                    break
                gone = self._admission.take_cancelled(is_cancelled)
                admitted = self._admission.admit(self._best_slot)
            now = time.perf_counter_ns()
            for job in gone:
                job.admitted_ns = now
                self._end(job, "cancel", now)
            for job, seq in admitted:  # active first: what fails fails it, never loses it
                job.seq, job.admitted_ns = seq, now
                self._active.append(job)
                try:  # one job that cannot start in its slot fails alone
                    job.on_device = self._device.take(seq, job.sampler.plain_greedy)
                    if job.on_device or not job.sampler.plain_greedy:
                        self._own_sampling.add(job)
                    self._reuse_prefix(job)
                except Exception as exc:
                    log.exception("starting a job failed on %s", self.name)
                    self._fail(job, f"its start in slot {seq} failed ({exc!r})")
            try:
                self._step()
            except Exception as exc:  # a bug here must fail jobs, never hang them
                log.exception("decode step failed on %s", self.name)
                for job in list(self._active):
                    self._fail(job, f"the decode loop failed ({exc!r})")
            if not self._active:  # no next step to hand them over before
                self._hand_over()
            times.step_ns += time.perf_counter_ns() - started
            times.steps += 1

    def _hand_over(self) -> None:
        """The last step's tokens and ends to the text relay, in one put, just before the
        next llama_decode: the relay makes their text while the step decodes (the GIL is
        free then), not while this thread admits jobs and lays the batch out (each ctypes
        call there would wait for the relay to let go of the GIL)."""
        if self._outbox:
            started = time.perf_counter_ns()
            self._relay.put(self._outbox)
            self._outbox = []
            self.times.emit_ns += time.perf_counter_ns() - started

    def _step(self) -> None:
        now = time.perf_counter_ns()
        for job in [j for j in self._active if j.halted or is_cancelled(j)]:
            self._end(job, "stop" if job.halted else "cancel", now)  # the relay says why
        outputs, in_batch, n = self._layout.fill(self._active)
        self._hand_over()
        if n == 0:
            return
        self._batch.n_tokens = n
        times = self.times
        decoding = time.perf_counter_ns()
        rc = self._L.llama_decode(self.ctx, self._batch)
        if rc == 0:  # a GPU returns before it is done: wait here, not in the first sample
            self._L.llama_synchronize(self.ctx)
        now = time.perf_counter_ns()
        times.decode_ns += now - decoding
        if rc != 0:
            self._decode_failed(rc, n, in_batch)
            return
        self._device.decoded()
        sampled = self._sample(outputs)
        times.sample_ns += time.perf_counter_ns() - now
        times.tokens += len(sampled)
        self._outbox.append(now)  # when these tokens were decoded, for the relay
        for (job, _idx), token in zip(outputs, sampled, strict=True):
            self._advance(job, token, now)

    def _sample(self, outputs: list[tuple[Job, int]]) -> list[int]:
        """Every output row's next token: plain greedy rows from one argmax over the
        step's logits (a call per sequence cost more than the argmax itself), llama.cpp's
        in-graph argmax (device sampling: then the logits hold no row of those), the
        rows of plain chains on the chain pool's threads (workers/engine/chains.py), the
        rest (a grammar, logprobs) by their job's sampler."""
        if not self._own_sampling:  # every row greedy on the host: nothing a row
            return self._greedy(len(outputs))
        device, ctx = self._device, self.ctx
        greedy = None
        if not any(job.on_device for job, _ in outputs) and any(
            job.sampler.plain_greedy for job, _ in outputs
        ):
            greedy = self._greedy(len(outputs))
        tokens, chains, rows = [0] * len(outputs), [], []
        for row, (job, idx) in enumerate(outputs):
            sampler = job.sampler
            if job.on_device:
                tokens[row] = device.token(idx)
            elif greedy is not None and sampler.plain_greedy:
                tokens[row] = greedy[row]
            elif sampler.chain_only:
                chains.append((sampler, idx))
                rows.append(row)
            else:
                tokens[row] = sampler.sample(ctx, idx)
        for row, token in zip(rows, self._chains.sample(chains), strict=True):
            tokens[row] = token
        return tokens

    def _advance(self, job: Job, token: int, now: int) -> None:
        job.generated += 1
        if not job.first_ns:
            job.first_ns = now
        piece, eog = self._tokenizer.piece(token)
        if eog:
            self._end(job, "stop", now)
            return
        self._outbox.append((job, token, piece))  # its text: the relay's
        if job.generated >= job.budget:
            self._end(job, "length", now)
        else:
            job.next_token = token

    def _end(self, job: Job, reason: str, now: int) -> None:
        """Retire ``job`` now; the relay makes its end after its text (its held-back text,
        unless cancelled or failed, its account, ``done``)."""
        self._outbox.append((job, reason, now, reason != "cancel"))
        self._retire(job, keep=job.error is None)

    def _fail(self, job: Job, why: str) -> None:
        job.error = job.failure(self.name, why)
        self._end(job, "error", 0)  # its KV may be half written: not kept

    def _best_slot(self, job: Job, free: list[int]) -> int:
        """The free slot whose cache serves most of ``job``'s prompt."""
        return best_slot(job.tokens, free, self._cached)

    def _reuse_prefix(self, job: Job) -> None:
        """Drop the slot's cache after the part ``job`` shares with it; skip that part."""
        L, seq = self._L, job.seq
        keep = reusable(self._cached.get(seq, []), job.tokens)
        if keep > 0 and L.llama_memory_seq_rm(self._mem, seq, keep, -1):
            # a sliding-window cache may have dropped what the next tokens attend to
            lowest = L.llama_memory_seq_pos_min(self._mem, seq)
            if self._n_swa == 0 or lowest <= max(0, keep - self._n_swa):
                job.fed = job.pos = keep
                job.decoded = job.tokens[:keep]
                job.cached = keep
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
        self._own_sampling.discard(job)
        job.sampler.free()

    def _decode_failed(self, rc: int, n: int, jobs: list[Job]) -> None:
        meaning = DECODE_ERRORS.get(rc, "fatal error in llama.cpp")
        why = f"llama_decode returned {rc} ({meaning}) for a batch of {n} tokens"
        log.error("%s on %s; failing %d jobs", why, self.name, len(jobs))
        for job in jobs:
            self._fail(job, why)

    def _shutdown(self, why: str) -> None:
        with self._cond:
            waiting = self._admission.drain()
        for job in [*self._active, *waiting]:
            try:  # its end is handed over first: one that fails to retire ends all the same
                self._fail(job, why)
            except Exception:
                log.exception("retiring a job of %s failed", self.name)

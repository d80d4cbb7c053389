"""A decode step's batch: which sequences decode, which prompt tokens join them, written
into the ``llama_batch``'s arrays.

A step in which every running sequence decodes one token and no prompt waits (nearly every
step of a busy runner) is written straight from the jobs, one row each in slot order, with
no object per token; a step with prompt tokens goes through :func:`prompt_take` and
:func:`batch_rows`, whose layout keeps llama.cpp's micro-batches few.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from workers.engine.batching import Feed, batch_rows, prompt_take
from workers.engine.job import Job

Outputs = list[tuple[Job, int]]  # each job whose row has logits, and that row
_seq = attrgetter("seq")


class Layout:
    """Fills one context's batch (its ``token``, ``pos``, ``seq_id`` and ``logits``
    arrays) with each step's rows, ``n_batch`` at most."""

    def __init__(self, batch: Any, n_batch: int) -> None:
        self._tokens, self._pos = batch.token, batch.pos
        self._seq_ids, self._logits = batch.seq_id, batch.logits
        self.n_batch = n_batch
        self._step_no = 0
        # each row's sequence id, when the row was last written with logits (-1: without,
        # or not written): a decode-only step rewrites only the rows whose sequence changed
        self._rows = [-1] * n_batch

    def fill(self, active: list[Job]) -> tuple[Outputs, list[Job], int]:
        """The next token of every running sequence, then prompt tokens as
        :func:`prompt_take` allows in the room n_batch leaves: (the rows with logits, the
        jobs in the batch, its number of rows)."""
        decoding = self.decoding(active)
        if all(len(job.tokens) <= job.fed for job in active):  # no prompt waits
            return self._decode_only(decoding), decoding, len(decoding)
        feeds = [(job, Feed(job.seq, [job.next_token], job.pos, True)) for job in decoding]
        room = self.n_batch - len(decoding)
        for job in active:
            left = len(job.tokens) - job.fed
            if left <= 0 or room <= 0:
                continue
            take, output = prompt_take(left, room, bool(decoding))
            chunk = job.tokens[job.fed : job.fed + take]
            feeds.append((job, Feed(job.seq, chunk, job.fed, output)))
            room -= take
        tokens, pos, seq_ids, logits = self._tokens, self._pos, self._seq_ids, self._logits
        outputs: Outputs = []
        rows = batch_rows([feed for _, feed in feeds])
        written = self._rows
        for n, (i, token, position, seq, output) in enumerate(rows):
            tokens[n], pos[n], seq_ids[n][0], logits[n] = token, position, seq, output
            written[n] = seq if output else -1
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

    def _decode_only(self, decoding: list[Job]) -> Outputs:
        """One row a sequence, in slot order, each with logits: :func:`batch_rows`'s layout
        of one-token feeds."""
        tokens, pos, seq_ids, logits = self._tokens, self._pos, self._seq_ids, self._logits
        rows = self._rows
        outputs: Outputs = []
        for n, job in enumerate(decoding):
            token, seq = job.next_token, job.seq
            tokens[n], pos[n] = token, job.pos
            if rows[n] != seq:  # a row's sequence and logits as last written, most steps
                seq_ids[n][0], logits[n], rows[n] = seq, True, seq
            outputs.append((job, n))
            job.decoded.append(token)
            job.pos += 1
            job.next_token = -1
        return outputs

    def decoding(self, active: list[Job]) -> list[Job]:
        """Sequences with a token to decode, in slot order: llama.cpp reuses the previous
        step's graph only for the same layout (a rotating order made steps 1.5x slower)."""
        ready = sorted((j for j in active if j.next_token >= 0), key=_seq)
        if len(ready) > self.n_batch:  # n_batch below num_parallel: take turns
            self._step_no += 1
            start = self._step_no % len(ready)
            ready = sorted((ready[start:] + ready[:start])[: self.n_batch], key=lambda j: j.seq)
        return ready

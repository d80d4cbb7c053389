"""Batch layout: which jobs hold the sequence slots, and what each puts into a step.

Pure logic, no llama.cpp: admission into free slots in arrival or fair order
(:class:`Admission`), the prompt prefix a slot's cache can serve again
(:func:`common_prefix`), how much of a prompt joins a step (:func:`prompt_take`), and the
rows of a ``llama_batch`` (:class:`Feed`, :func:`batch_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from scheduler.fairness import FairQueue

T = TypeVar("T")
log = logging.getLogger(__name__)


class Admission(Generic[T]):
    """Jobs waiting for a slot, and the free sequence ids.

    Jobs are admitted in arrival order, or, with ``classify`` (job → tenant, priority,
    weight), in fair order across tenants, interactive before batch within a tenant
    (:class:`scheduler.fairness.FairQueue`)."""

    def __init__(
        self, n_slots: int, classify: Callable[[T], tuple[str, str, float]] | None = None
    ) -> None:
        self.waiting: FairQueue[T] = FairQueue()
        self.free = list(range(n_slots))
        self._classify = classify

    def push(self, job: T) -> None:
        if self._classify is None:
            self.waiting.push(job, "")
            return
        tenant, priority, weight = self._classify(job)
        self.waiting.push(job, tenant, "batch" if priority == "batch" else "interactive", weight)

    def take_cancelled(self, is_cancelled: Callable[[T], bool]) -> list[T]:
        return self.waiting.remove_if(is_cancelled)

    def admit(self, choose: Choose[T] | None = None) -> list[tuple[T, int]]:
        """Waiting jobs, in their order, paired with the free slots they take: the one
        ``choose(job, free slots)`` names (:func:`by_reuse`, :func:`best_slot`), else (or
        should it raise) the lowest."""
        admitted = []
        while self.waiting and self.free:
            job = self.waiting.pop()
            slot = min(self.free)
            if choose:
                try:  # the job is out of the queue: a rule that fails must not lose it
                    slot = choose(job, self.free)
                except Exception:
                    log.exception("choosing a slot failed; the job takes the lowest free one")
            self.free.remove(slot)
            admitted.append((job, slot))
        return admitted

    def release(self, seq: int) -> None:
        self.free.append(seq)
        self.free.sort()

    def drain(self) -> list[T]:
        jobs = list(self.waiting)
        self.waiting = FairQueue()
        return jobs


Choose = Callable[[T, list[int]], int]  # a waiting job, the free slots → the slot it takes


def by_reuse(reuse: Callable[[T, int], int]) -> Choose[T]:
    """The slot rule: the free slot where ``reuse(job, slot)`` (cached prompt tokens the job
    can reuse there) is largest, the lowest slot on a tie."""

    def choose(job: T, free: list[int]) -> int:
        return max(free, key=lambda s: (reuse(job, s), -s))

    return choose


def reusable(cached: list[int], tokens: list[int]) -> int:
    """Tokens of a prompt a slot whose cache holds ``cached`` serves again: their common
    prefix, bar the prompt's last token (it is evaluated again: it starts the answer)."""
    return min(common_prefix(cached, tokens), len(tokens) - 1)


def best_slot(tokens: list[int], free: list[int], cached: dict[int, list[int]]) -> int:
    """:func:`by_reuse` of :func:`reusable` over the slots' caches (``cached``: slot →
    tokens whose KV it holds), with fewer comparisons (the rule took 27 us a job against
    4 us, with 24 free slots of 8 prompts' caches): only a cache that starts with the
    prompt's first two tokens can serve two or more, the rest serve one (the same first
    token) or none; one that holds the whole prompt serves all it can, and its prefix is
    one comparison, not a search."""
    n = len(tokens) - 1
    if n >= 2:
        head = tokens[:2]
        serving = [s for s in free if cached.get(s, [])[:2] == head]
        whole = tokens[:n]  # all a cache can serve: the lowest slot that does
        full = [s for s in serving if cached[s][:n] == whole]
        if full:
            return min(full)
        if serving:  # each serves its common prefix, short of n
            return max(serving, key=lambda s: (common_prefix(cached[s], tokens), -s))
    if n >= 1:
        first = tokens[:1]
        same = [s for s in free if cached.get(s, [])[:1] == first]
        if same:
            return min(same)
    return min(free)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start: slices compared in C, halving
    the span (a loop in Python took 3 us a slot for a short prompt, 100 us for 2,000
    tokens, at each admission for every free slot)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same], a[:differs] != b[:differs]
    while differs - same > 1:
        mid = (same + differs) // 2
        if a[same:mid] == b[same:mid]:
            same = mid
        else:
            differs = mid
    return same


class Feed(NamedTuple):
    """What one sequence puts into a decode step: ``tokens`` from position ``pos`` on, and
    whether the last of them needs logits. (A tuple: a step with a joining prompt makes one
    for every running sequence, and a frozen dataclass cost 1.5 us each.)"""

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

"""Many sequences' sampler chains in one step, on several threads.

A job that samples with llama.cpp's chain (temperature, top-k/p, min-p, penalties) costs
one ``llama_sampler_sample`` call a step: it copies the whole vocabulary into candidates
and filters them, about 0.3 ms on a 262k vocabulary, so at 32 such sequences the decode
thread sampled for ~10 ms between two decodes, longer than a GPU's step. Each call lets go
of the GIL and touches only its own chain and the context's logits, so the calls of one
step run on :class:`ChainPool`'s threads at once, the decode thread taking a share too.

Before the threads read the logits, the decode thread calls ``llama_get_logits`` once: it
waits for the device and puts the rows in the batch's order (llama.cpp reorders them on
the first read after a decode), so that the threads' reads change nothing in the context.
Each chain keeps its own random state: the tokens are those one thread would sample.

Only where the vocabulary is large: on a small one a call is mostly its fixed cost, and
handing rows to threads costs more than it saves.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MIN_VOCAB = 32768  # below it a row's sampling is too short to hand to a thread
MAX_THREADS = 8


class ChainPool:
    """The threads that sample one context's chains: ``threads`` in all, the decode
    thread one of them (none of its own with fewer than two); None: one a core, at most
    :data:`MAX_THREADS`, where the vocabulary has :data:`MIN_VOCAB` tokens or more."""

    def __init__(self, L: Any, ctx: Any, n_vocab: int, threads: int | None = None) -> None:
        self._L, self._ctx = L, ctx
        if threads is None:
            threads = min(MAX_THREADS, os.cpu_count() or 1) if n_vocab >= MIN_VOCAB else 1
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="chains")
            if self.threads > 1
            else None
        )

    def sample(self, chains: list[tuple[Any, int]]) -> list[int]:
        """The token each ``(chain, output row)`` samples, in order."""
        pool, parts = self._pool, min(self.threads, len(chains))
        if pool is None or parts < 2:
            return self._sample(chains)
        self._L.llama_get_logits(self._ctx)  # synchronized and reordered here, once
        size = -(-len(chains) // parts)
        shares = [chains[i : i + size] for i in range(0, len(chains), size)]
        futures = [pool.submit(self._sample, share) for share in shares[1:]]
        tokens = self._sample(shares[0])
        for future in futures:
            tokens += future.result()
        return tokens

    def _sample(self, chains: list[tuple[Any, int]]) -> list[int]:
        sample, ctx = self._L.llama_sampler_sample, self._ctx
        return [int(sample(chain, ctx, idx)) for chain, idx in chains]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

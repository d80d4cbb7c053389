"""Many sequences' sampler chains in one step, on several threads.

A job that samples with llama.cpp's chain (temperature, top-k/p, min-p, penalties) costs
one ``llama_sampler_sample`` call a step: it copies the whole vocabulary into candidates
and filters them. On the demo model's 262k vocabulary that was 28 ms of a 159 ms step at
32 sequences on the 2-core machine (0.9 ms a call), and a GPU's whole step takes a few ms.
Each call lets go of the GIL and works on its own chain (its candidates, random state,
penalties), so the plain chains of one step run on :class:`ChainPool`'s threads at once,
the decode thread taking a share too; rows with a grammar or logprobs stay on the decode
thread (their Python reads the logits).

Before the threads read the logits, the decode thread calls ``llama_get_logits`` once: it
waits for the device and puts the rows in the batch's order (llama.cpp reorders them on
the first read after a decode), so that the threads only read them. Each call still runs
llama.cpp's ``synchronize``: a no-op on the CPU and a stream wait on CUDA, both safe from
several threads, but not on Metal or Vulkan, whose synchronize changes shared state: the
pool is used only where llama.cpp's backends are the CPU and CUDA. The tokens are those one
thread would sample.

Only where the vocabulary is large: a call's fixed cost and the GIL taken back after it
outweigh what a thread saves on a small one. On the 2-core machine, 32 sequences of tiny
models that differ only in their vocabulary, two threads against one (bench/README): 260
tokens 40-70 % slower, 32k 7-11 % slower, 64k 7-11 % faster, 128k 40 % faster (sampling a
step). A host with more cores has the crossover lower, unmeasured.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from workers.engine.sampling import Sampler

MIN_VOCAB = 65536  # below it a row's sampling is too short to hand to a thread
MAX_THREADS = 8
SAFE_BACKENDS = {"CPU", "CUDA"}  # whose synchronize several threads may call at once


def safe_backends(L: Any) -> bool:
    """Whether llama.cpp's backends in this build are only :data:`SAFE_BACKENDS` (its
    system info names each: "CUDA : ARCHS = 900 | … | CPU : AVX2 = 1 | …")."""
    info = L.llama_print_system_info().decode(errors="replace")
    return set(re.findall(r"(\w+) : ", info)) <= SAFE_BACKENDS


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a container's or taskset's share
    except (AttributeError, OSError):  # no affinity API (not Linux)
        return os.cpu_count() or 1


class ChainPool:
    """The threads that sample one context's chains: ``threads`` in all, the decode
    thread one of them (none of its own with fewer than two). None: one for each CPU this
    process may use (``cores`` at most, the runner's threads if it was given a number),
    up to :data:`MAX_THREADS`, where the vocabulary has :data:`MIN_VOCAB` tokens or more
    and the backends are safe; else 1."""

    def __init__(
        self, L: Any, ctx: Any, n_vocab: int, threads: int | None = None, cores: int | None = None
    ) -> None:
        self._L, self._ctx = L, ctx
        if threads is None:
            wide = n_vocab >= MIN_VOCAB and safe_backends(L)
            threads = min(MAX_THREADS, usable_cpus(), cores or MAX_THREADS) if wide else 1
        self.threads = max(1, threads)
        self.pooled = 0  # steps whose chains ran on several threads (tests, benches)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="chains")
            if self.threads > 1
            else None
        )

    def sample(self, chains: list[tuple[Sampler, int]]) -> list[int]:
        """The token each ``(sampler, output row)`` samples (a sampler whose token is its
        chain's alone: :attr:`Sampler.chain_only`), in order."""
        pool, parts = self._pool, min(self.threads, len(chains))
        if pool is None or parts < 2:
            return self._sample(chains)
        self._L.llama_get_logits(self._ctx)  # synchronized and reordered here, once
        size = -(-len(chains) // parts)
        shares = [chains[i : i + size] for i in range(0, len(chains), size)]
        futures = [pool.submit(self._sample, share) for share in shares[1:]]
        try:
            tokens = self._sample(shares[0])
        finally:  # no thread may still read a chain or the logits once this returns
            wait(futures)
        for future in futures:
            tokens += future.result()
        self.pooled += 1
        return tokens

    def _sample(self, chains: list[tuple[Sampler, int]]) -> list[int]:
        ctx = self._ctx
        return [sampler.sample(ctx, idx) for sampler, idx in chains]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

"""Greedy sampling inside ``llama_decode``, on the device that computed the logits.

A plain greedy job's token is its logits' argmax. Taken on the host, every step copies each
sequence's logits off the device (n_vocab floats: 512 KB a sequence for a 128k vocabulary)
and reads them through once more in numpy: on an H200 at 64 sequences, 2.8 ms of a 9.7 ms
step (bench/README.md). llama.cpp's backend sampling (``llama_set_sampler``, marked
experimental) adds the argmax to the decode graph; when every output of a micro-batch has
such a sampler, llama.cpp copies no logits at all, and the loop reads one token id a
sequence.

Measured, it does not pay yet, so it is off unless GGUFQ_DEVICE_SAMPLING is set: on an
H200 (1B model, 64 new tokens a job) the host's argmax went (2.86 → 0.32 ms a step at P =
64) but llama_decode grew by more (5.48 → 8.82 ms): tokens/s -2 % at P = 8, +2 % at 32,
-9 % at 64; on a CPU the graph's argmax costs what numpy's saved. The tokens are the same.

A slot keeps its greedy chain attached while greedy jobs use it; a job that samples
otherwise (temperature, penalties, a grammar) detaches it for its time. Each attach or
detach makes llama.cpp reserve its compute graph again at the next decode, so a slot
changes only when a job of the other kind takes it. llama.cpp initializes a chain for the
device once (a second attach of the same chain aborts the process), so a slot that comes
back to greedy gets a new chain; a detached one is freed after the next decode, whose graph
no longer holds it.
"""

from __future__ import annotations

from typing import Any


class DeviceGreedy:
    """The greedy chains of a context's slots, attached where the slot's job is greedy."""

    def __init__(self, L: Any, ctx: Any, enabled: bool = False) -> None:
        """``enabled``: GGUFQ_DEVICE_SAMPLING, and llama.cpp has the API."""
        self._L, self._ctx = L, ctx
        self.enabled = (
            enabled
            and hasattr(L, "llama_set_sampler")
            and hasattr(L, "llama_get_sampled_token_ith")
        )
        self._chains: dict[int, Any] = {}  # slot → its attached chain
        self._detached: list[Any] = []  # to free once a decode ran without them
        self.attaches = self.detaches = self.tokens = 0  # what it did, for tests and benches

    def take(self, seq: int, greedy: bool) -> bool:
        """A job starts in slot ``seq``: whether its tokens come from the device (else the
        host samples them from the logits, which llama.cpp then copies out)."""
        if not self.enabled:
            return False
        L = self._L
        if seq in self._chains:
            if greedy:
                return True
            L.llama_set_sampler(self._ctx, seq, None)
            self._detached.append(self._chains.pop(seq))
            self.detaches += 1
            return False
        if not greedy:
            return False
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        if not L.llama_set_sampler(self._ctx, seq, chain):
            L.llama_sampler_free(chain)
            return False  # not offloadable here (a model split by tensor): on the host
        # registered even where the output's device lacks the argmax ("-greedy", not
        # "+greedy"): then it would yield no token, and no logits either
        if not L.llama_sampler_name(L.llama_sampler_chain_get(chain, 0)).startswith(b"+"):
            L.llama_set_sampler(self._ctx, seq, None)
            self._detached.append(chain)
            return False
        self._chains[seq] = chain
        self.attaches += 1
        return True

    def decoded(self) -> None:
        """A decode ran: its graph holds no detached chain any more."""
        if self._detached:
            for chain in self._detached:
                self._L.llama_sampler_free(chain)
            self._detached.clear()

    def token(self, idx: int) -> int:
        """The token the device sampled for the batch's output ``idx``."""
        token = int(self._L.llama_get_sampled_token_ith(self._ctx, idx))
        self.tokens += 1
        if token < 0:
            raise RuntimeError(f"llama.cpp sampled no token on the device for output {idx}")
        return token

    def free(self) -> None:
        """After the context is freed: the chains it used."""
        for chain in [*self._chains.values(), *self._detached]:
            self._L.llama_sampler_free(chain)
        self._chains.clear()
        self._detached.clear()

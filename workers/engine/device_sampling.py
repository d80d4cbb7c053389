"""Greedy sampling inside ``llama_decode``, on the device that computed the logits.

A plain greedy job's token is its logits' argmax. Taken on the host, every step copies each
sequence's logits off the device (n_vocab floats: 512 KB a sequence for a 128k vocabulary)
and reads them through once more in numpy: on an H200 at 64 sequences, 2.8 ms of a 9.7 ms
step (bench/README.md). llama.cpp's backend sampling (``llama_set_sampler``, marked
experimental) adds the argmax to the decode graph; when every output of a micro-batch has
such a sampler, llama.cpp copies no logits at all, and the loop reads one token id a
sequence.

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

    def __init__(self, L: Any, ctx: Any, mode: str = "auto", n_gpu_layers: int = 0) -> None:
        """``mode``: GGUFQ_DEVICE_SAMPLING (auto: where the runner's layers are on a GPU; on
        a CPU the graph's argmax costs about what numpy's saves)."""
        self._L, self._ctx = L, ctx
        on_gpu = n_gpu_layers != 0 and bool(L.llama_supports_gpu_offload())
        wanted = mode == "on" or (mode == "auto" and on_gpu)
        self.enabled = (
            wanted and hasattr(L, "llama_set_sampler") and hasattr(L, "llama_get_sampled_token_ith")
        )
        self._chains: dict[int, Any] = {}  # slot → its attached chain
        self._detached: list[Any] = []  # to free once a decode ran without them

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
            return False
        if not greedy:
            return False
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        if not L.llama_set_sampler(self._ctx, seq, chain):
            L.llama_sampler_free(chain)
            return False  # not offloadable here (a model split by tensor): on the host
        self._chains[seq] = chain
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
        if token < 0:
            raise RuntimeError(f"llama.cpp sampled no token on the device for output {idx}")
        return token

    def free(self) -> None:
        """After the context is freed: the chains it used."""
        for chain in [*self._chains.values(), *self._detached]:
            self._L.llama_sampler_free(chain)
        self._chains.clear()
        self._detached.clear()

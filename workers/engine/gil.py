"""The llama.cpp calls a decode loop makes between two decodes, bound to keep the GIL.

ctypes lets go of the GIL around every call into a ``CDLL``, and taking it back waits for
whichever thread took it meanwhile: the text relay, a caller preparing its job, the chunk
writer. A decode loop makes a few short calls between two ``llama_decode`` calls (the
logits' address, a slot's cache dropped or cut, its lowest position, a token sampled on
the device), and each of those waited for another thread's Python: at 64 sequences of a
tiny model on 2 cores, ``_reuse_prefix`` (two such calls) took 33 us a call on average
against a median of 10 us, its tail all GIL waits (``bench/step_split.py``).

Bound through ``ctypes.PyDLL`` (the same library, the same functions), these calls keep
the GIL: each is short and calls no Python (llama.cpp's log callback takes the GIL again on
the same thread, which is safe). ``llama_get_logits`` and ``llama_get_sampled_token_ith``
wait for the device inside, so they are short only because the loop calls
``llama_synchronize`` (which lets go of the GIL) right after each ``llama_decode``: keep
that call. ``llama_decode``, ``llama_synchronize`` and the jobs' sampler chains (a large
vocabulary's) still let it go.

Only where the whole model runs on a GPU: there the other threads' Python runs while the
GPU decodes, on cores nothing else needs. On the CPU it would run beside llama.cpp's own
threads instead, and take their cores: kept on the 2-core machine, the decode thread's
Python fell from 11.8-12.5 % of a 1.7-1.9 ms step to 9.3-10.1 % at 64 sequences, but
tokens per second fell 6 % at 64 and 10 % at 32 (means of three rounds; ``bench/
step_split.py --gil keep``, bench/README). Not yet measured on a GPU.
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

KEPT = (  # the decode loop's own (a job's sampler chain binds llama_cpp for itself)
    "llama_get_logits",
    "llama_memory_seq_rm",
    "llama_memory_seq_pos_min",
    "llama_get_sampled_token_ith",
)


class KeepsGil:
    """``llama_cpp`` with the :data:`KEPT` functions bound to keep the GIL; every other
    name is the module's own. A name this build of llama.cpp lacks stays the module's."""

    def __init__(self, L: ModuleType) -> None:
        self._L = L
        lib = ctypes.PyDLL(L.llama_cpp._lib._name)
        for name in KEPT:
            plain = getattr(L, name, None)
            kept = getattr(lib, name, None)
            if plain is None or kept is None:
                continue
            kept.argtypes, kept.restype = plain.argtypes, plain.restype
            setattr(self, name, kept)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._L, name)


def keeping_gil(L: ModuleType, all_layers_offloaded: bool, keep: bool | None = None) -> Any:
    """``L`` for a decode loop: :class:`KeepsGil` where ``keep`` says, or (None) where
    every layer is offloaded to a GPU this build of llama.cpp can use (a model split
    between a GPU and the CPU computes much of each step on llama.cpp's CPU threads)."""
    if keep is None:
        keep = all_layers_offloaded and bool(L.llama_supports_gpu_offload())
    return KeepsGil(L) if keep else L

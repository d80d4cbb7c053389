"""Counting a prompt's tokens on the gateway (Anthropic's ``count_tokens``): the model's
vocabulary read from its GGUF file (llama.cpp's vocab-only load: no weights, a fraction of
a second), kept for the few models asked about last, and the prompt tokenized as a runner
tokenizes it (special tokens parsed, BOS added when the model asks)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from scheduler.errors import InvalidModelFile

KEPT = 4  # vocabularies kept loaded


class Vocabularies:
    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._models: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def count(self, path: str, text: str) -> int:
        """The tokens of ``text`` for the model at ``path``."""
        import llama_cpp as L

        with self._lock:  # one at a time: a model freed while another thread used it
            vocab = self._vocab(L, path)
            data = text.encode()
            n = L.llama_tokenize(vocab, data, len(data), None, 0, False, True)
            if n < 0:
                buf = (L.llama_token * -n)()
                n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
            return int(n) + (1 if L.llama_vocab_get_add_bos(vocab) else 0)

    def _vocab(self, L: Any, path: str) -> Any:
        model = self._models.pop(path, None)
        if model is None:
            # as the workers do: llama.cpp's info lines are noise in the gateway's log
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
            L.llama_backend_init()
            params = L.llama_model_default_params()
            params.vocab_only = True
            model = L.llama_model_load_from_file(path.encode(), params)
            if not model:
                raise InvalidModelFile(
                    f"llama.cpp could not read the vocabulary of {path}; check the file "
                    "(`ggufq models` says what is wrong with it)"
                )
            while len(self._models) >= self.kept:
                _, oldest = self._models.popitem(last=False)
                L.llama_model_free(oldest)
        self._models[path] = model  # the most recent last
        return L.llama_model_get_vocab(model)

    def close(self) -> None:
        import llama_cpp as L

        with self._lock:
            while self._models:
                L.llama_model_free(self._models.popitem()[1])

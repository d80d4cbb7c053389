"""A runner loaded for embeddings: one slot, and a batch as large as its context, because
llama.cpp embeds an input in one batch."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from scheduler.errors import InvalidRequest
from scheduler.protocol import RunnerConfig
from workers.cpus import llama
from workers.resident import Resident

POOLING_MEAN = 1


@dataclass
class EmbedStats:
    embeddings: list[list[float]]
    prompt_eval_count: int


class Embedder(Resident):
    def __init__(
        self,
        runner_id: str,
        model: str,
        path: str,
        config: RunnerConfig,
        device_ids: list[str],
        n_gpu_layers: int,
        n_threads: int | None,
        keep_alive_s: float,
        pooling_type: int = -1,
    ) -> None:
        Llama = llama().Llama  # heavy import: only in processes that run models
        super().__init__(runner_id, model, config, device_ids, keep_alive_s)
        self.turn = threading.Lock()
        self.llm = self.timed_load(
            lambda: Llama(
                model_path=path,
                embedding=True,
                n_ctx=config.num_ctx,
                n_batch=config.n_batch,
                n_ubatch=config.n_ubatch,
                flash_attn=config.flash_attn,  # as placement estimated it
                # the model's own pooling; a generative model (none) is mean-pooled, so
                # that each input gives one vector
                pooling_type=pooling_type if pooling_type > 0 else POOLING_MEAN,
                n_gpu_layers=n_gpu_layers,
                n_threads=n_threads,
                verbose=False,
            )
        )

    def embed(self, inputs: list[str], truncate: bool) -> EmbedStats:
        """One L2-normalized vector per input, in order; inputs longer than the context are
        refused unless ``truncate``."""
        with self.turn:
            n_ctx = self.llm.n_ctx()
            counts = [len(self.llm.tokenize(text.encode(), add_bos=True)) for text in inputs]
            too_long = [(i, n) for i, n in enumerate(counts) if n > n_ctx]
            if too_long and not truncate:
                i, n = too_long[0]
                raise InvalidRequest(
                    f"input {i} is {n} tokens but the embedding context holds {n_ctx} "
                    f"({len(too_long)} of {len(inputs)} inputs are too long); shorten it, "
                    "raise options.num_ctx, or set truncate=True to cut it"
                )
            vectors = self.llm.embed(inputs, normalize=True, truncate=True)
        return EmbedStats(
            embeddings=[list(map(float, v)) for v in vectors],
            prompt_eval_count=sum(min(n, n_ctx) for n in counts),
        )

    def close(self) -> None:
        with self.turn:
            self.llm.close()

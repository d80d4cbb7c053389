"""A runner: one llama.cpp model and context, resident between jobs.

Jobs on one runner take turns (one decode loop, never two threads in one llama.cpp
context); the worker-runtime issue replaces the turn-taking with continuous batching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.errors import InvalidRequest, JobFailed
from scheduler.estimate import RunnerConfig
from scheduler.protocol import Options

# ggml type ids of the KV cache types (ggml.h: GGML_TYPE_F32 = 0, F16 = 1, Q4_0 = 2, ...)
GGML_KV_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}


@dataclass
class GenerationStats:
    text: str
    done_reason: str
    prompt_eval_count: int
    prompt_eval_duration_ns: int
    eval_count: int
    eval_duration_ns: int

    def ollama_fields(self) -> dict[str, Any]:
        """The final record's fields under Ollama's names."""
        return {
            "response": self.text,
            "done_reason": self.done_reason,
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": self.prompt_eval_duration_ns,
            "eval_count": self.eval_count,
            "eval_duration": self.eval_duration_ns,
        }


class Runner:
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
    ) -> None:
        from llama_cpp import Llama  # heavy import: only in processes that run models

        self.id = runner_id
        self.model = model
        self.config = config
        self.device_ids = device_ids
        self.keep_alive_s = keep_alive_s
        self.turn = threading.Lock()
        started = time.perf_counter_ns()
        kv_type = GGML_KV_TYPES[config.kv_type]
        # Exactly the context the estimator sized (scheduler.estimate.context_sizes).
        self.llm = Llama(
            model_path=path,
            n_ctx=config.num_ctx * config.num_parallel,
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch,
            flash_attn=config.flash_attn,
            swa_full=config.swa_full,
            type_k=kv_type,
            type_v=kv_type,
            n_gpu_layers=n_gpu_layers,
            n_threads=n_threads,
            verbose=False,
        )
        self.load_duration_ns = time.perf_counter_ns() - started

    def generate(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> GenerationStats:
        with self.turn:
            return self._generate(prompt, options, on_text, cancelled)

    def _generate(
        self,
        prompt: str,
        options: Options,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool],
    ) -> GenerationStats:
        from llama_cpp import StoppingCriteriaList

        n_prompt = len(self.llm.tokenize(prompt.encode(), add_bos=True, special=True))
        if n_prompt >= self.llm.n_ctx():
            raise InvalidRequest(
                f"prompt is {n_prompt} tokens but the context holds {self.llm.n_ctx()}; "
                "shorten the prompt or raise options.num_ctx"
            )
        limit = options.num_predict if options.num_predict > 0 else 0
        generated = 0
        hit_limit = was_cancelled = False

        def check(ids: Any, _logits: Any) -> bool:
            # Called once per sampled token (and once more at the end) with the context so
            # far; llama-cpp-python lets byte tokens run past max_tokens, so the limit is
            # enforced here too.
            nonlocal generated, hit_limit, was_cancelled
            count = len(ids) - n_prompt + 1
            if limit and count > limit:
                hit_limit = True
                return True
            generated = max(generated, count)
            was_cancelled = cancelled()
            return was_cancelled

        started = time.perf_counter_ns()
        first = None
        parts: list[str] = []
        reason = "stop"
        try:
            stream = self.llm.create_completion(
                prompt,
                max_tokens=limit or -1,
                temperature=options.temperature,
                top_p=options.top_p,
                top_k=options.top_k,
                min_p=options.min_p,
                repeat_penalty=options.repeat_penalty,
                presence_penalty=options.presence_penalty,
                frequency_penalty=options.frequency_penalty,
                seed=None if options.seed < 0 else options.seed,
                stop=options.stop,
                stream=True,
                stopping_criteria=StoppingCriteriaList([check]),
            )
            for chunk in stream:
                choice: dict[str, Any] = chunk["choices"][0]  # type: ignore[index,assignment]
                if first is None:
                    first = time.perf_counter_ns()
                if choice["text"]:
                    parts.append(choice["text"])
                    on_text(choice["text"])
                reason = choice.get("finish_reason") or reason
        except (ValueError, RuntimeError) as exc:
            raise JobFailed(
                f"llama.cpp failed while generating with {self.model!r}: {exc}"
            ) from None
        ended = time.perf_counter_ns()
        first = first or ended
        return GenerationStats(
            text="".join(parts),
            done_reason=_done_reason(was_cancelled, hit_limit or reason == "length"),
            prompt_eval_count=n_prompt,
            prompt_eval_duration_ns=first - started,
            eval_count=generated,
            eval_duration_ns=ended - first,
        )

    def close(self) -> None:
        with self.turn:
            self.llm.close()


def _done_reason(cancelled: bool, at_limit: bool) -> str:
    if cancelled:
        return "cancel"
    return "length" if at_limit else "stop"

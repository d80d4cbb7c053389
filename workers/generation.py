"""Runners and what a job produces on one: the runner a placement asks for, text streamed
with progress reports, or vectors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scheduler.chat import chat_text
from scheduler.errors import JobCancelled, JobFailed
from scheduler.gguf.metadata import read_model_info
from scheduler.gguf.registry import Registry
from scheduler.midstream import SoFar
from scheduler.protocol import JobRequest, Message, Placement
from scheduler.settings import Settings
from scheduler.store.hops import wall
from scheduler.store.streams import so_far
from scheduler.thinking import ThinkSplitter, can_think, opens_thinking
from scheduler.tooluse import (
    call_schema,
)
from workers.answer import Answer
from workers.backlog import patiently
from workers.devices import tensor_split
from workers.embedder import Embedder
from workers.fitting import fit_chat, fit_prompt, room_to_generate
from workers.handback import runner_stopped
from workers.keepalive import effective_keep_alive
from workers.publisher import ChunkPublisher
from workers.runner import Runner

Clock = Callable[[], float]
Progress = Callable[..., None]
AnyRunner = Runner | Embedder


class Ticker:
    """Publishes each piece of text and reports GENERATING with the count so far, at most
    once every ``every_s`` seconds (pieces are tokens, but for multi-byte characters)."""

    def __init__(
        self,
        progress: Progress,
        publish: Callable[[str], None],
        every_s: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.progress, self.publish, self.every_s, self.clock = progress, publish, every_s, clock
        self.count = 0
        self.next_at = clock()

    def __call__(self, text: str) -> None:
        self.publish(text)
        self.count += 1
        now = self.clock()
        if now >= self.next_at:
            self.next_at = now + self.every_s
            self.progress("generating", tokens=self.count)


def generate(
    req: JobRequest,
    runner: AnyRunner,
    publisher: ChunkPublisher,
    cancelled: Callable[[], bool],
    prompt: str,
    progress: Progress,
    meanwhile: Callable[[], None] = lambda: None,
    thinking: ThinkSplitter | None = None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """Generated text, streamed as it comes: parted into thinking (``thinking``: the
    splitter of a template that can think), answer text and tool calls (:mod:`answer`,
    which adds to ``warnings``)."""
    if not isinstance(runner, Runner):
        raise JobFailed(f"runner {runner.id} is loaded for embeddings; it cannot generate")
    if req.resumed:  # its run elsewhere stopped mid-answer: it goes on from there
        publisher.resume(_so_far(req, publisher))
    answer = Answer(req, publisher.publish, thinking, warnings)
    ticker = Ticker(progress, answer)
    share = (req.tenant, req.priority, req.weight)
    format = call_schema(req.tools, req.tool_choice, req.parallel_tool_calls) or req.format
    args = (prompt, req.options, ticker, cancelled, format, share, meanwhile, publisher.tokens)
    try:
        stats = runner.generate(*args)
    except JobFailed:
        if runner.stopped and not req.resumed and not publisher.tokens:
            # its runner's decode loop stopped before its first token: nothing of it ran
            raise runner_stopped(req, ", ".join(runner.device_ids), runner.stopped) from None
        raise
    if stats.admitted_ns:
        publisher.admitted_at = wall(stats.admitted_ns)
    if stats.done_reason == "cancel":
        raise JobCancelled(f"job {req.id} was cancelled after {stats.eval_count} generated tokens")
    cut = stats.done_reason == "length"
    out = {**stats.ollama_fields(), **answer.fields(stats.text, cut)}
    if req.resumed:  # where it went on from, and how soon the next text came
        went_on = (  # two hosts' clocks: clamped at 0 where they disagree
            max(0.0, publisher.first_token_at - req.resumed[-1].at)
            if publisher.first_token_at
            else None
        )
        last = req.resumed[-1].model_copy(update={"went_on_s": went_on})
        out["resumed"] = [r.model_dump() for r in [*req.resumed[:-1], last]]
    return out


def _so_far(req: JobRequest, publisher: ChunkPublisher) -> SoFar:
    """What the stream of a resumed job holds of its answer."""
    note = req.resumed[-1]
    held = patiently(lambda: so_far(publisher.r, req.id), f"resuming job {req.id}", 30.0)
    if not held.complete or held.seq != note.chunks:
        raise JobFailed(
            f"job {req.id} cannot go on from where its run on {note.device} stopped: its "
            f"stream holds {held.seq} whole chunks of the {note.chunks} it had (Redis lost "
            "some, or they carry no token ids: written by an older ggufq worker); submit it "
            "again"
        )
    return held


def embed(req: JobRequest, runner: AnyRunner) -> dict[str, Any]:
    if not isinstance(runner, Embedder):
        raise JobFailed(f"runner {runner.id} is loaded for generation; it cannot embed")
    stats = runner.embed(req.input, req.truncate)
    return {
        "embeddings": stats.embeddings,
        "prompt_eval_count": stats.prompt_eval_count,
        "done_reason": "stop",
    }


def open_runner(
    req: JobRequest,
    placement: Placement,
    registry: Registry,
    settings: Settings,
    on_load: Callable[[float], None] | None = None,
) -> AnyRunner:
    """Load the runner a placement asks for: llama.cpp's layers and devices as placed;
    ``on_load`` hears the load's progress (a fraction; a generating runner's only)."""
    path = registry.resolve(req.model)
    info = read_model_info(path)  # a clear error for a bad file before llama.cpp
    config = placement.config
    common: dict[str, Any] = {
        "n_gpu_layers": placement.n_gpu_layers,
        "n_threads": settings.cpu_threads or None,
        "keep_alive_s": effective_keep_alive(req.keep_alive_s, settings.keep_alive_s),
    }
    args = (placement.runner_id, req.model, str(path), config, placement.devices)
    if config.embedding:
        return Embedder(*args, **common, pooling_type=info.pooling_type)
    split = tensor_split(placement.devices, placement.split_blocks)
    return Runner(
        *args,
        **common,
        load_timeout_s=settings.load_timeout_s,
        split=split,
        device_sampling=settings.device_sampling,
        on_load=on_load,
    )


def produce(
    req: JobRequest,
    runner: AnyRunner,
    placement: Placement,
    registry: Registry,
    publisher: ChunkPublisher,
    cancelled: Callable[[], bool],
    progress: Progress,
    meanwhile: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """What the job is for: vectors, generated text (streamed), or just a loaded runner.
    ``meanwhile()`` runs once before any of it is published: while the first step of
    generated text runs, before anything else."""
    out: dict[str, Any]
    warnings = list(placement.warnings)
    if req.kind == "embed":
        meanwhile()
        out = embed(req, runner)
    elif req.kind == "chat" or req.prompt:
        fit = _fitter(req, runner, warnings)
        prompt, thinking = (
            chat_prompt(req, registry, warnings, fit)
            if req.kind == "chat"
            else (fit(lambda _m: req.prompt), None)
        )
        out = generate(
            req, runner, publisher, cancelled, prompt, progress, meanwhile, thinking, warnings
        )
    else:
        meanwhile()
        out = {"response": "", "done_reason": "load" if runner.keep_alive_s else "unload"}
    if warnings:
        out["warnings"] = warnings
    return out


Render = Callable[[list[Message]], str]


def _fitter(req: JobRequest, runner: AnyRunner, warnings: list[str]) -> Callable[[Render], str]:
    """How the job's prompt is made from its messages (``render``): whole, or with
    ``truncate`` cut to fit its slot (:mod:`workers.fitting`), with a warning that says so."""

    def fit(render: Render) -> str:
        if not req.truncate or not isinstance(runner, Runner):
            return render(req.messages)
        num_ctx = runner.config.num_ctx
        limit = num_ctx - room_to_generate(num_ctx, req.options.num_predict)

        def count(text: str) -> int:
            return len(runner.engine.tokenize(text))

        if req.kind == "chat":
            fitted = fit_chat(req.messages, render, count, limit)
        else:
            fitted = fit_prompt(render([]), count, limit)
        if (warning := fitted.warning()) is not None:
            warnings.append(warning)
        return fitted.prompt

    return fit


def chat_prompt(
    req: JobRequest,
    registry: Registry,
    warnings: list[str],
    fit: Callable[[Render], str] | None = None,
) -> tuple[str, ThinkSplitter | None]:
    """The chat's messages rendered with the model's own template (a warning without one),
    made to fit by ``fit``, and the splitter of its thinking when the template can think."""
    info = read_model_info(registry.resolve(req.model))
    if not info.chat_template:
        warnings.append(
            f"model {req.model!r} has no chat template in its metadata; the messages were "
            "rendered as a plain 'Role: text' transcript"
        )

    def render(messages: list[Message]) -> str:
        job = req.model_copy(update={"messages": messages})
        return chat_text(job, info.chat_template, info.bos_text, info.eos_text)

    prompt = render(req.messages) if fit is None else fit(render)
    thinks = can_think(info.chat_template)
    return prompt, ThinkSplitter(inside=opens_thinking(prompt)) if thinks else None

"""A job made ready in its caller's thread, before the decode loop has it: its prompt's
tokens, its sampler chain, and a resumed job's answer so far (scheduler/midstream.py)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.errors import InvalidRequest
from scheduler.protocol import Options
from workers.engine.job import Job
from workers.engine.sampling import Sampler, _penalty_history, sampler_plan
from workers.engine.text import StopMatcher, Tokenizer, token_budget


def new_job(
    tokenizer: Tokenizer,
    name: str,
    num_ctx: int,
    prompt: str,
    options: Options,
    on_text: Callable[[str], None],
    cancelled: Callable[[], bool],
    grammar: str | None,
    answer: list[int] | None = None,
) -> Job:
    """The job of ``prompt`` on a runner of ``name`` whose slots hold ``num_ctx`` tokens.
    ``answer``: the list its sampled tokens are appended to; a resumed job's holds its
    answer so far, evaluated after the prompt and replayed (:meth:`Job.replay`) before the
    loop samples what comes next. Within ``num_predict``, those tokens count as generated."""
    prompt_tokens = tokenizer.tokenize(prompt)
    out = [] if answer is None else answer
    if len(prompt_tokens) >= num_ctx:  # an answer so far that fills the rest: replay ends it
        raise InvalidRequest(
            f"prompt is {len(prompt_tokens)} tokens but a slot of {name!r} holds "
            f"{num_ctx} (options.num_ctx), leaving no room to generate; "
            "shorten the prompt or raise options.num_ctx"
        )
    plan = sampler_plan(options, num_ctx)
    sampler = Sampler(tokenizer, plan, grammar, _penalty_history(plan, prompt_tokens))
    return Job(
        tokens=prompt_tokens + out,
        budget=token_budget(options.num_predict, num_ctx, len(prompt_tokens)),
        sampler=sampler,
        on_text=on_text,
        cancelled=cancelled,
        stops=StopMatcher(options.stop),
        out=out,
        forced=len(out),
        generated=len(out),
    )

"""Chat messages to a prompt, with the model's own chat template from its GGUF metadata.

Pure: the template, messages and special-token texts in, the prompt out. Templates are
Jinja (as in Hugging Face tokenizers), run in a sandbox. The worker renders a chat job's
prompt with :func:`chat_text`; the gateway does too, to count its tokens.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from types import FrameType
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler.errors import InvalidRequest
from scheduler.protocol import JobRequest
from scheduler.thinking import can_think, template_switches
from scheduler.tooluse import has_tool_place, offered, template_messages, template_tools

# For models without a template (base models such as the demo): a plain transcript.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


MAX_TEMPLATE_STEPS = 2_000_000  # lines a template may run for one prompt
MAX_TEMPLATE_S = 5.0  # seconds a template may take for one prompt
_CHECK_EVERY = 10_000  # steps between looks at the clock


def _raise(message: str) -> None:
    raise TemplateError(message)


class TemplateTooLong(TemplateError):
    """A template ran past its bound (a loop that does not end, by accident or design)."""


@contextmanager
def _bounded() -> Iterator[None]:
    """Run a template in this thread with a bound on its steps and time: a template (it
    comes with the model file) whose loops never end would hold the job, and its slot,
    for good, deaf to its cancellation. Counts the lines run in the template's own code
    ("<template>") with a trace function; another tracer (a coverage tool) goes on
    everywhere else."""
    before = sys.gettrace()
    started, steps = time.monotonic(), 0

    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps % _CHECK_EVERY == 0:
                if steps > MAX_TEMPLATE_STEPS or time.monotonic() - started > MAX_TEMPLATE_S:
                    raise TemplateTooLong(
                        f"it ran past {MAX_TEMPLATE_STEPS:,} steps or {MAX_TEMPLATE_S:g} s "
                        "(a loop that does not end)"
                    )
        return in_template

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == "<template>":
            return in_template
        return before(frame, event, arg) if before is not None else None  # type: ignore[arg-type]

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(before)


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: list[dict[str, Any]],
    bos_text: str = "",
    eos_text: str = "",
    model: str = "",
    variables: dict[str, Any] | None = None,
) -> str:
    """The prompt for ``messages``, ending where the assistant's answer starts; further
    ``variables`` for the template: tools for a template that has a place for them
    (``scheduler.tooluse``), thinking switches (``scheduler.thinking``).

    A leading BOS text is dropped: the runner adds BOS when tokenizing, as the model asks.
    """
    extra = variables or {}
    try:
        with _bounded():
            prompt = _compile(template or FALLBACK_TEMPLATE).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=bos_text,
                eos_token=eos_text,
                **extra,
            )
    except TemplateTooLong as exc:
        raise InvalidRequest(
            f"the chat template of model {model!r} did not finish: {exc}; the model file's "
            "template is broken: export the model again with a working one"
        ) from None
    except TemplateError as exc:
        raise InvalidRequest(
            f"the chat template of model {model!r} refused these messages: {exc}; check the "
            "roles and their order (most templates want user and assistant turns to alternate)"
        ) from None
    if bos_text and prompt.startswith(bos_text):
        prompt = prompt[len(bos_text) :]
    return str(prompt)


def chat_text(req: JobRequest, template: str, bos_text: str = "", eos_text: str = "") -> str:
    """A chat job's prompt as its model's template (and special-token texts) renders it:
    the messages, the tools it offers (in the template's own place for them, else in the
    generic form) and its think switches. Raises InvalidRequest when it asks a model that
    cannot think to think, or when the template refuses the messages."""
    if req.think and not can_think(template):
        raise InvalidRequest(
            f"model {req.model!r} does not think (its chat template has no thinking mode): "
            "leave out think, or set it false"
        )
    tools = offered(req.tools, req.tool_choice)
    native = bool(template) and has_tool_place(template)
    dumped = [
        m.model_dump(mode="json", exclude_none=True, exclude={"thinking"}) for m in req.messages
    ]
    variables = template_switches(req.think)
    if native and tools:
        variables["tools"] = template_tools(tools)
    messages = template_messages(dumped, tools, native)
    return render(template, messages, bos_text, eos_text, req.model, variables)

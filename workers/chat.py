"""Chat messages to a prompt, with the model's own chat template from its GGUF metadata.

Pure: the template, messages and special-token texts in, the prompt out. Templates are
Jinja (as in Hugging Face tokenizers), run in a sandbox.
"""

from __future__ import annotations

import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler.errors import InvalidRequest

# For models without a template (base models such as the demo): a plain transcript.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


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
) -> str:
    """The prompt for ``messages``, ending where the assistant's answer starts.

    A leading BOS text is dropped: the runner adds BOS when tokenizing, as the model asks.
    """
    try:
        prompt = _compile(template or FALLBACK_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos_text,
            eos_token=eos_text,
        )
    except TemplateError as exc:
        raise InvalidRequest(
            f"the chat template of model {model!r} refused these messages: {exc}; check the "
            "roles and their order (most templates want user and assistant turns to alternate)"
        ) from None
    if bos_text and prompt.startswith(bos_text):
        prompt = prompt[len(bos_text) :]
    return str(prompt)

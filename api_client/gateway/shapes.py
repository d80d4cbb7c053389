"""Shapes the HTTP APIs share (OpenAI's, Anthropic's, Ollama's): text sent as a list of
parts, a call an assistant made with its arguments as JSON text or as an object, and a
reasoning effort. Pure: no I/O."""

from __future__ import annotations

import json
from typing import Any

from scheduler.errors import InvalidRequest


def text_of(content: object, where: str) -> str:
    """Text sent as a string or as a list of text parts (``{"type": "text", "text": …}``,
    as OpenAI's and Anthropic's APIs allow); anything else is refused, named."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be text or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        text = part.get("text", "") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(text, str):
            raise InvalidRequest(
                f"{where}: a part of type {kind!r} is not supported: ggufq serves text "
                "models; send text parts only"
            )
        parts.append(text)
    return "".join(parts)


def called(call: dict[str, Any]) -> dict[str, Any]:
    """A call an assistant made, as a job carries it: arguments as an object (OpenAI's
    clients send them as JSON text, Ollama's as an object)."""
    function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidRequest(
                f"the arguments of the call to {function.get('name')!r} are not JSON "
                f"({arguments[:80]!r}): send them as a JSON object"
            ) from None
    out = {"function": {"name": function.get("name"), "arguments": arguments}}
    return {**out, "id": call["id"]} if isinstance(call.get("id"), str) else out


def think_for_effort(effort: object) -> dict[str, Any]:
    """OpenAI's reasoning effort as a job's ``think``: none, minimal → false (no thinking),
    low / medium / high as they are; unset: the model's default."""
    if effort is None:
        return {}
    if effort in ("none", "minimal"):
        return {"think": False}
    if effort not in ("low", "medium", "high"):
        raise InvalidRequest(
            f"reasoning effort {effort!r} is not understood: send none, minimal, low, medium "
            "or high"
        )
    return {"think": effort}

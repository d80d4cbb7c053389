"""Tools a chat job offers its model, and how they reach the model's prompt (issue 35).

The request side of tool calling; :mod:`scheduler.toolcalls` reads the calls back out of
what the model wrote. Pure: no I/O.

- A chat template that has a place for tools (it uses a ``tools`` variable, as most
  templates of 2024 and later do) gets them there, in the Hugging Face shape, with the
  assistant's earlier calls and the tools' answers as the template expects them.
- A template without one (and the plain fallback) gets them in a system message in the
  **generic form**: the tools as JSON, and the instruction to answer a call with only
  ``{"tool_calls": [{"name": …, "arguments": {…}}]}``; earlier calls are written that way
  in the assistant's turn, and the tools' answers become a user turn.
- ``tool_choice`` ``required`` or a named tool constrains the answer with a JSON schema of
  that generic form (:func:`call_schema`), so even a weak model returns a valid call.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.bounds import check_schema

TOOL_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
MAX_TOOLS = 128
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

GENERIC_INSTRUCTIONS = (
    "You can call the tools below. To call one or more, answer with only this JSON, and "
    'nothing before or after it: {"tool_calls": [{"name": "<a tool\'s name>", '
    '"arguments": {<its arguments>}}]}. Otherwise answer as usual.\n\nThe tools:'
)


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=TOOL_NAME)
    description: str = Field("", max_length=16_384)
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(NO_PARAMETERS))

    @model_validator(mode="after")
    def _parameters(self) -> ToolFunction:
        check_schema(self.parameters, f"the parameters of tool {self.name!r}")
        return self


class Tool(BaseModel):
    """One tool the model may call: OpenAI's and Ollama's shape."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: ToolFunction


class NamedTool(BaseModel):
    """``tool_choice`` naming the one tool the answer must call."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME)


ToolChoice = Literal["auto", "none", "required"] | NamedTool


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=TOOL_NAME)
    arguments: dict[str, Any] = Field(default_factory=dict)


class MessageToolCall(BaseModel):
    """A call the assistant made: Ollama's shape, arguments as an object."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = Field(None, max_length=128)
    function: CalledFunction


def check_choice(tools: list[Tool], choice: ToolChoice, kind: str, format: object) -> None:
    """Raise ValueError when the job's tools and tool_choice do not go together."""
    if tools and kind != "chat":
        raise ValueError("tools are offered in a chat only: send messages, kind 'chat'")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: two tools share a name ({sorted(names)}): name each once")
    if choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools: offer at least one")
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    if format is not None and (choice == "required" or isinstance(choice, NamedTool)):
        raise ValueError(
            "format and a required tool call both constrain the answer: send one of them"
        )
    schema = call_schema(tools, choice, True)
    if schema is not None:  # the tools' schemas together: the grammar a worker builds
        check_schema(schema, "the tools offered for a required call, together,")


def offered(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the model is shown: none when ``tool_choice`` is none."""
    return [] if choice == "none" else tools


def call_schema(tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema an answer must follow when ``choice`` demands a call (required: any
    of ``tools``; a named tool: that one), in the generic form; None when it does not."""
    if choice in ("auto", "none"):
        return None
    chosen = [
        t for t in tools if not isinstance(choice, NamedTool) or t.function.name == choice.name
    ]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    array: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
        "maxItems": MAX_TOOLS if parallel else 1,
    }
    return {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


# what a template that renders tools asks its model to write a call with, for the formats
# scheduler/toolcalls.py reads (Hermes / Qwen, Mistral, Llama 3's ipython role): a template
# whose model calls in another format gets the generic form, which that reader does read
KNOWN_CALLS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "ipython")


def has_tool_place(template: str) -> bool:
    """Whether a chat template renders tools (it reads a ``tools`` variable) for a model
    whose calls :mod:`scheduler.toolcalls` reads."""
    return "tools" in template and any(marker in template for marker in KNOWN_CALLS)


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as chat templates take them (Hugging Face's shape)."""
    return [t.model_dump(mode="json") for t in tools]


def template_messages(
    messages: list[dict[str, Any]], tools: list[Tool], native: bool
) -> list[dict[str, Any]]:
    """Messages (Ollama's shape, as a job carries them) for a template: with a place for
    tools (``native``), calls and answers in Hugging Face's shape; without, in the
    generic form, the tools described in the system message (or, without one, at the
    head of the first user turn: some templates have no system role). A tool's answer
    that names only its call's id is named after the call's tool."""
    messages = _named_answers(messages)
    if native:
        return [_native(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            answer = f"The tool {m.get('tool_name') or 'called'} answered: {m['content']}"
            out.append(_user_turn(out, answer, answered=True))
        elif m["role"] == "user":
            out.append(_user_turn(out, m["content"]))
        elif m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}
                for c in m["tool_calls"]
            ]
            written = json.dumps({"tool_calls": calls})
            content = f"{m['content']}\n{written}" if m.get("content") else written
            out.append({"role": m["role"], "content": content})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("answered", None)
    if tools:
        described = "\n".join(json.dumps(t.function.model_dump(mode="json")) for t in tools)
        instructions = f"{GENERIC_INSTRUCTIONS}\n{described}"
        at = next((n for n, m in enumerate(out) if m["role"] in ("system", "user")), None)
        if at is None:
            out.insert(0, {"role": "system", "content": instructions})
        else:
            out[at] = {**out[at], "content": f"{instructions}\n\n{out[at]['content']}"}
    return out


def _user_turn(out: list[dict[str, Any]], content: str, answered: bool = False) -> dict[str, Any]:
    """A user turn, joined to the tools' answers just before it (one turn: templates that
    want turns to alternate refuse two user turns in a row)."""
    if out and out[-1].get("answered"):
        before = out.pop()
        content = f"{before['content']}\n{content}"
    turn: dict[str, Any] = {"role": "user", "content": content}
    if answered:
        turn["answered"] = True
    return turn


def _named_answers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            if call.get("id"):
                names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool" and not m.get("tool_name") and m.get("tool_call_id") in names:
            m = {**m, "tool_name": names[m["tool_call_id"]]}
        out.append(m)
    return out


def short_id(call_id: str) -> str:
    """A call's id as 9 letters and digits: Mistral's templates refuse any other length."""
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _native(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_name")}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "id": short_id(c.get("id") or f"{n}"), "function": c["function"]}
            for n, c in enumerate(m["tool_calls"])
        ]
    if m["role"] == "tool":
        if m.get("tool_name"):
            out["name"] = m["tool_name"]
        if m.get("tool_call_id"):
            out["tool_call_id"] = short_id(m["tool_call_id"])
    return out

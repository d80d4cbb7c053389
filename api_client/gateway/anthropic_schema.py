"""Anthropic's Messages API (``POST /v1/messages``): its request body as a ggufq chat job,
and a job's answer as its message object or its stream of events. Pure: no I/O.

Content blocks map onto the chat's messages: ``text`` is text, an assistant's ``tool_use``
is a tool call, a user's ``tool_result`` is a ``tool`` message (named by the earlier
``tool_use`` it answers); ``thinking`` blocks sent back are dropped (the template shows no
earlier thinking); ``thinking`` enabled or disabled is the job's ``think``, and the
answer's thinking comes as a thinking block (with an empty signature);
``output_config.format`` (a JSON schema) constrains the answer; images and documents are
refused with a 400. ``temperature``, ``top_p`` and ``top_k`` are taken when sent (older
clients do; Anthropic's own API no longer has them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_client.gateway.errors import http_error, public
from api_client.gateway.shapes import text_of
from scheduler.errors import GgufqError, InvalidRequest
from scheduler.protocol import GenerateResponse

# Anthropic's error types by status (its SDK raises by status, shows the type)
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# thinking as Anthropic's block; its signature (Anthropic's proof that it wrote it) is empty
THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}
KEEPALIVE = b'event: ping\ndata: {"type":"ping"}\n\n'  # Anthropic's own keep-alive event


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    output_config: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def think_fields(self) -> dict[str, Any]:
        """``thinking`` as the job's ``think``: enabled or disabled (adaptive, or none:
        the model's default)."""
        kind = (self.thinking or {}).get("type")
        return {"think": kind == "enabled"} if kind in ("enabled", "disabled") else {}

    def job_format(self) -> dict[str, Any] | None:
        """``output_config.format`` (structured output: a JSON schema) as the job's format."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise InvalidRequest(
                f"output_config.format {fmt!r} is not understood: send "
                "{'type': 'json_schema', 'schema': {...}}"
            )
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("output_config.format needs a 'schema' object")
        return schema

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_predict": self.max_tokens}
        out["temperature"] = 1.0 if self.temperature is None else self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.stop_sequences:
            out["stop"] = self.stop_sequences
        return out

    def job_fields(self) -> dict[str, Any]:
        """The chat job's messages and tool fields."""
        system = text_of(self.system, "system")
        turns = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            turns.extend(_turns(message))
        fields: dict[str, Any] = {"messages": turns, **self.think_fields()}
        if self.tools:
            fields["tools"] = [_tool(t) for t in self.tools]
        choice = self.tool_choice or ToolChoice()
        if self.tools or choice.type in ("any", "tool"):
            fields["tool_choice"] = _choice(choice)
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a message's request without ``max_tokens``."""

    max_tokens: int = Field(1, ge=1)


def _turns(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as the chat's messages: a user's tool results each become a
    ``tool`` message (named after its call by the job), before the text beside them."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, answers = [], [], []
    for block in message.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(text_of([block], "a text block"))
        elif kind == "tool_use" and message.role == "assistant":
            call_id, name = str(block.get("id", "")), str(block.get("name", ""))
            calls.append(
                {"id": call_id, "function": {"name": name, "arguments": block.get("input") or {}}}
            )
        elif kind == "tool_result" and message.role == "user":
            call_id = str(block.get("tool_use_id", ""))
            answer: dict[str, Any] = {"role": "tool", "tool_call_id": call_id}
            answer["content"] = text_of(block.get("content"), "a tool_result's content")
            if block.get("is_error"):
                answer["content"] = f"(error) {answer['content']}"
            answers.append(answer)
        elif kind not in ("thinking", "redacted_thinking"):
            raise InvalidRequest(
                f"a content block of type {kind!r} is not supported by ggufq: it serves text "
                "models; send text, tool_use and tool_result blocks"
            )
    out = list(answers)
    if texts or calls or not answers:
        turn: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type", "custom")
    if kind not in ("custom", None):
        raise InvalidRequest(
            f"tool type {kind!r} is one of Anthropic's server tools, not served by ggufq: "
            "describe the tool with name, description and input_schema"
        )
    function = {
        "name": tool.get("name"),
        "description": tool.get("description") or "",
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


def _choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type 'tool' needs the tool's name")
        return {"name": choice.name}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def stop_reason(final: GenerateResponse) -> str:
    if final.tool_calls:
        return "tool_use"
    if final.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if final.done_reason == "length" else "end_turn"


def usage(final: GenerateResponse | None) -> dict[str, int]:
    if final is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": final.prompt_eval_count or 0, "output_tokens": final.eval_count or 0}


def tool_uses(final: GenerateResponse) -> list[dict[str, Any]]:
    return [
        {"type": "tool_use", "id": c.id or f"toolu_{final.job_id}_{n}", "name": c.function.name}
        | {"input": c.function.arguments}
        for n, c in enumerate(final.tool_calls)
    ]


def message_object(job_id: str, model: str, final: GenerateResponse | None) -> dict[str, Any]:
    """The answer as Anthropic's message: whole (``final``), or as a stream begins."""
    content: list[dict[str, Any]] = []
    if final is not None:
        if final.thinking:
            content.append({**THINKING_BLOCK, "thinking": final.thinking})
        if final.response:
            content.append({"type": "text", "text": final.response})
        content.extend(tool_uses(final))
    return {
        "id": f"msg_{job_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(final) if final is not None else None,
        "stop_sequence": None if final is None else final.stop_sequence,
        "usage": usage(final),
    }


def sse(kind: str, data: dict[str, Any]) -> bytes:
    body = json.dumps({"type": kind, **data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


@dataclass
class MessageStream:
    """A job's chunks as Anthropic's stream events: message_start, a thinking block and a
    text block (each its start, deltas and stop), a block per tool call (its input as one
    JSON delta), message_delta with the stop reason and usage, message_stop."""

    job_id: str
    model: str
    _started: bool = False
    _blocks: int = 0  # content blocks begun
    _open: Literal["thinking", "text", None] = None  # the block open now

    def encode(self, chunk: GenerateResponse) -> list[bytes]:
        frames: list[bytes] = []
        if not self._started:
            self._started = True
            frames.append(
                sse("message_start", {"message": message_object(self.job_id, self.model, None)})
            )
        if chunk.done:
            return frames + self._end(chunk)
        if chunk.thinking:
            frames += self._delta(
                "thinking", {"type": "thinking_delta", "thinking": chunk.thinking}
            )
        if chunk.response:
            frames += self._delta("text", {"type": "text_delta", "text": chunk.response})
        return frames

    def _delta(self, kind: Literal["thinking", "text"], delta: dict[str, Any]) -> list[bytes]:
        """A delta of a block of ``kind``, which begins (closing another) if not open."""
        frames = []
        if self._open != kind:
            frames += self._close()
            self._open = kind
            empty = {"type": "text", "text": ""} if kind == "text" else THINKING_BLOCK
            frames.append(
                sse("content_block_start", {"index": self._blocks, "content_block": empty})
            )
        return [*frames, sse("content_block_delta", {"index": self._blocks, "delta": delta})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._blocks, None
        self._blocks += 1
        return [sse("content_block_stop", {"index": index})]

    def _end(self, final: GenerateResponse) -> list[bytes]:
        frames = self._close()
        for use in tool_uses(final):
            start = {"index": self._blocks, "content_block": {**use, "input": {}}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
            frames += [
                sse("content_block_start", start),
                sse("content_block_delta", {"index": self._blocks, "delta": delta}),
                sse("content_block_stop", {"index": self._blocks}),
            ]
            self._blocks += 1
        end = {"stop_reason": stop_reason(final), "stop_sequence": final.stop_sequence}
        frames.append(sse("message_delta", {"delta": end, "usage": usage(final)}))
        return [*frames, sse("message_stop", {})]


def error_body(exc: GgufqError, status: int) -> dict[str, Any]:
    kind = _ERROR_TYPE.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": public(str(exc))}}


def error_event(exc: GgufqError) -> bytes:
    return sse("error", {"error": error_body(exc, http_error(exc).status)["error"]})

"""OpenAI's Responses API, stateless (``POST /v1/responses``): its request as a ggufq chat
job, and a job's answer as a response object or its stream of events. Pure: no I/O.

Input items map onto the chat's messages: a message (text, or ``input_text`` /
``output_text`` parts) is a turn, ``function_call`` items are the assistant's calls,
``function_call_output`` items the tools' answers; ``reasoning`` items sent back are
dropped. Nothing is stored: ``previous_response_id`` is refused with a 400 that says to
send the conversation in ``input`` (as the Agents SDK and LangChain do by default).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from api_client.gateway.errors import public
from api_client.gateway.shapes import called, text_of, think_for_effort
from scheduler.errors import GgufqError, InvalidRequest
from scheduler.protocol import GenerateResponse

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
        }
        if self.max_output_tokens is not None:
            out["num_predict"] = self.max_output_tokens
        return out

    def job_fields(self) -> dict[str, Any]:
        """The chat job's messages, tool fields and think."""
        if self.previous_response_id:
            raise InvalidRequest(
                "previous_response_id is not served: ggufq keeps no responses; send the "
                "whole conversation in input (and store false)"
            )
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )
        for item in items:
            _add(turns, item)
        fields: dict[str, Any] = {"messages": turns}
        if self.tools:
            fields["tools"] = [_tool(t) for t in self.tools]
        if self.tools or self.tool_choice not in (None, "auto", "none"):
            fields["tool_choice"] = _choice(self.tool_choice)
            fields["parallel_tool_calls"] = self.parallel_tool_calls is not False
        return fields | think_for_effort((self.reasoning or {}).get("effort"))

    def job_format(self) -> Literal["json"] | dict[str, Any] | None:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return "json"
        if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
            return dict(fmt["schema"])
        raise InvalidRequest(
            f"text.format {fmt!r} is not understood: send type 'text', 'json_object', or "
            "'json_schema' with a 'schema'"
        )


def _add(turns: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """One input item onto the chat's messages (calls join the assistant turn before)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise InvalidRequest(
                f"an input message's role {item.get('role')!r} is not one of {sorted(_ROLES)}"
            )
        turns.append(
            {"role": role, "content": text_of(_parts(item.get("content")), "a message's content")}
        )
    elif kind == "function_call":
        call = called(
            {
                "id": item.get("call_id"),
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
        )
        if (
            turns
            and turns[-1]["role"] == "assistant"
            and (turns[-1].get("tool_calls") or not turns[-1]["content"])
        ):
            turns[-1].setdefault("tool_calls", []).append(call)
        else:
            turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = (
            output
            if isinstance(output, str)
            else text_of(_parts(output), "a function_call_output's output")
        )
        turns.append({"role": "tool", "content": content, "tool_call_id": item.get("call_id")})
    elif kind != "reasoning":
        raise InvalidRequest(
            f"an input item of type {kind!r} is not served by ggufq: send messages, "
            "function_call and function_call_output items"
        )


def _parts(content: Any) -> Any:
    """The Responses API's text parts (input_text, output_text) as plain text parts."""
    if not isinstance(content, list):
        return content
    return [
        {**p, "type": "text"}
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(
            f"tool type {tool.get('type')!r} is one of OpenAI's hosted tools, not served by "
            "ggufq: send function tools"
        )
    function = {
        k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.get("type") == "function" and choice.get("name"):
        return {"name": choice["name"]}
    raise InvalidRequest(
        f"tool_choice {choice!r} is not understood: send 'auto', 'none', 'required' or "
        "{'type': 'function', 'name': ...}"
    )


def _usage(final: GenerateResponse | None) -> dict[str, Any]:
    prompt = final.prompt_eval_count or 0 if final else 0
    completion = final.eval_count or 0 if final else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _reasoning(job_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{job_id}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message(job_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    content = [part] if status == "completed" else []
    return {
        "type": "message",
        "id": f"msg_{job_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _calls(final: GenerateResponse) -> list[dict[str, Any]]:
    return [
        {
            "type": "function_call",
            "id": f"fc_{final.job_id}_{n}",
            "call_id": call.id or f"call_{final.job_id}_{n}",
            "name": call.function.name,
            "arguments": json.dumps(call.function.arguments),
            "status": "completed",
        }
        for n, call in enumerate(final.tool_calls)
    ]


def output_items(final: GenerateResponse) -> list[dict[str, Any]]:
    items = [_reasoning(final.job_id, final.thinking)] if final.thinking else []
    if final.response or not final.tool_calls:
        items.append(_message(final.job_id, final.response))
    return items + _calls(final)


def response_object(
    job_id: str,
    body: ResponsesRequest,
    final: GenerateResponse | None,
    created: float | None = None,
) -> dict[str, Any]:
    """The response: whole (``final``), or as a stream begins (in progress, no output)."""
    cut = final is not None and final.done_reason == "length"
    return {
        "id": f"resp_{job_id}",
        "object": "response",
        "created_at": int(created or time.time()),
        "status": "in_progress" if final is None else "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.model,
        "instructions": body.instructions,
        "output": output_items(final) if final is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None,
        "store": False,
        "metadata": {},
        "usage": _usage(final) if final is not None else None,
    }


@dataclass
class ResponseStream:
    """A job's chunks as the Responses API's events: response.created and .in_progress,
    a reasoning item and a message item (each added, its deltas, done), an item per
    function call (its arguments as one delta), response.completed."""

    job_id: str
    body: ResponsesRequest
    _seq: int = 0
    _items: int = 0  # output items begun
    _open: Literal["reasoning", "message", None] = None
    _text: list[str] = field(default_factory=list)

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        self._seq += 1
        body = json.dumps(
            {"type": kind, "sequence_number": self._seq, **data}, separators=(",", ":")
        )
        return f"event: {kind}\ndata: {body}\n\n".encode()

    def encode(self, chunk: GenerateResponse) -> list[bytes]:
        frames: list[bytes] = []
        if self._seq == 0:
            begun = response_object(self.job_id, self.body, None)
            frames += [self.event("response.created", {"response": begun})]
            frames += [self.event("response.in_progress", {"response": begun})]
        if chunk.done:
            return frames + self._end(chunk)
        if chunk.thinking:
            frames += self._delta("reasoning", "response.reasoning_text.delta", chunk.thinking)
        if chunk.response:
            frames += self._delta("message", "response.output_text.delta", chunk.response)
        return frames

    def _at(self) -> dict[str, Any]:
        item_id = f"rs_{self.job_id}" if self._open == "reasoning" else f"msg_{self.job_id}"
        return {"item_id": item_id, "output_index": self._items, "content_index": 0}

    def _delta(self, kind: Literal["reasoning", "message"], event: str, text: str) -> list[bytes]:
        frames = []
        if self._open != kind:
            frames += self._close()
            self._open, self._text = kind, []
            if kind == "message":
                item = _message(self.job_id, "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item, part = _reasoning(self.job_id, ""), {"type": "reasoning_text", "text": ""}
            frames.append(
                self.event(
                    "response.output_item.added", {"output_index": self._items, "item": item}
                )
            )
            frames.append(self.event("response.content_part.added", {**self._at(), "part": part}))
        self._text.append(text)
        return [*frames, self.event(event, {**self._at(), "delta": text})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        text, at = "".join(self._text), self._at()
        if self._open == "message":
            item, part = (
                _message(self.job_id, text),
                {"type": "output_text", "text": text, "annotations": []},
            )
            done = [self.event("response.output_text.done", {**at, "text": text})]
        else:
            item, part = _reasoning(self.job_id, text), {"type": "reasoning_text", "text": text}
            done = [self.event("response.reasoning_text.done", {**at, "text": text})]
        done.append(self.event("response.content_part.done", {**at, "part": part}))
        done.append(
            self.event("response.output_item.done", {"output_index": self._items, "item": item})
        )
        self._open = None
        self._items += 1
        return done

    def _end(self, final: GenerateResponse) -> list[bytes]:
        frames = self._close()
        for call in _calls(final):
            at = {"item_id": call["id"], "output_index": self._items}
            frames.append(
                self.event(
                    "response.output_item.added",
                    {
                        "output_index": self._items,
                        "item": {**call, "arguments": "", "status": "in_progress"},
                    },
                )
            )
            frames.append(
                self.event(
                    "response.function_call_arguments.delta", {**at, "delta": call["arguments"]}
                )
            )
            frames.append(
                self.event(
                    "response.function_call_arguments.done", {**at, "arguments": call["arguments"]}
                )
            )
            frames.append(
                self.event("response.output_item.done", {"output_index": self._items, "item": call})
            )
            self._items += 1
        whole = response_object(self.job_id, self.body, final)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        return [*frames, self.event(kind, {"response": whole})]

    def error(self, exc: GgufqError) -> bytes:
        return self.event("error", {"code": exc.code, "message": public(str(exc)), "param": None})

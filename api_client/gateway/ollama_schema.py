"""Ollama's request bodies and response records, field for field (ollama/api/types.go).

Pure: no I/O. What a ggufq runner cannot honour (a custom ``template``, ``suffix``,
``images``, a ``context`` from an earlier answer) is refused with a 400 that says what to
send instead. Tools are served: ``tools``, an assistant's ``tool_calls`` (its arguments an
object) and ``tool`` messages with ``tool_name``; so is ``think`` (the answer's
``thinking`` apart from its text).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_client.gateway.errors import ollama_body
from api_client.gateway.shapes import called
from scheduler.errors import GgufqError, InvalidRequest
from scheduler.protocol import GenerateResponse
from scheduler.units import parse_duration_s

STATS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)
FOREVER = "2318-01-01T00:00:00Z"  # what Ollama shows as the expiry of a model kept forever


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    truncate: bool = False  # a prompt the context cannot hold: cut (oldest turns), not a 400

    def logprob_options(self) -> dict[str, Any]:
        """``logprobs`` and ``top_logprobs`` as the job's option (none: not asked)."""
        return {"top_logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def job_fields(self) -> dict[str, Any]:
        """``think`` and ``truncate`` as a job carries them (none: the defaults)."""
        fields: dict[str, Any] = {} if self.think is None else {"think": self.think}
        return {**fields, "truncate": True} if self.truncate else fields

    def job_format(self) -> Literal["json"] | dict[str, Any] | None:
        return self.format or None

    def unloads(self) -> bool:
        """keep_alive 0: the model unloads (at once, for a request with nothing to do)."""
        if self.keep_alive is None:
            return False
        try:
            return parse_duration_s(self.keep_alive) == 0
        except ValueError as exc:
            raise InvalidRequest(f"keep_alive: {exc}") from None


class GenerateRequest(_Request):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] = Field(default_factory=list)
    raw: bool = False
    images: list[str] = Field(default_factory=list)

    def refuse_unsupported(self) -> None:
        if self.template:
            _refuse(
                "template",
                "ggufq renders prompts with the model's own chat template (from its GGUF "
                "metadata); leave out 'template', or send raw: true with the prompt already "
                "templated",
            )
        if self.suffix:
            _refuse("suffix", "fill-in-the-middle is not served; put the text in the prompt")
        if self.context:
            _refuse("context", "send the conversation with /api/chat's messages instead")
        _refuse_images(bool(self.images))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    name: str | None = None  # what some clients send for tool_name

    def turn(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [called(c) for c in self.tool_calls]
        if self.role == "tool" and (self.tool_name or self.name):
            out["tool_name"] = self.tool_name or self.name
        return out


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)

    def refuse_unsupported(self) -> None:
        _refuse_images(any(m.images for m in self.messages))

    def turns(self) -> list[dict[str, Any]]:
        return [m.turn() for m in self.messages]


def made_calls(final: GenerateResponse) -> list[dict[str, Any]]:
    """The tool calls an answer made, in Ollama's shape (none: a plain answer)."""
    return [{"function": c.function.model_dump(mode="json")} for c in final.tool_calls]


class EmbedRequest(_Request):
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingsRequest(_Request):
    """The legacy /api/embeddings: one prompt, one vector."""

    prompt: str = ""


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    name: str = ""  # older clients send the model as 'name'
    verbose: bool = False


def _refuse(field: str, what_to_do: str) -> None:
    raise InvalidRequest(f"'{field}' is not supported by ggufq: {what_to_do}")


def _refuse_images(images: bool) -> None:
    if images:
        _refuse("images", "ggufq serves text models; send text only")


def timestamp(seconds: float) -> str:
    """Ollama's created_at: RFC 3339 in UTC with sub-second digits."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def stats(final: GenerateResponse) -> dict[str, Any]:
    fields = final.model_dump(include=set(STATS))
    return {k: v for k, v in fields.items() if v is not None}


def generate_record(
    model: str,
    chunk: GenerateResponse,
    text: str | None = None,
    chat: bool = False,
    calls: bool = True,
) -> dict[str, Any]:
    """One line of /api/generate or /api/chat. ``text`` overrides the chunk's text and
    thinking (the streamed final line carries neither: the chunks before it carried it
    all); ``calls`` False leaves the answer's tool calls out (a stream sends them on a line
    of their own)."""
    content = chunk.response if text is None else text
    thought = chunk.thinking if text is None else ""
    out: dict[str, Any] = {"model": model, "created_at": timestamp(chunk.created_at)}
    if chat:
        out["message"] = {"role": "assistant", "content": content}
        if thought:
            out["message"]["thinking"] = thought
        if calls and (made := made_calls(chunk)):
            out["message"]["tool_calls"] = made
    else:
        out["response"] = content
        if thought:
            out["thinking"] = thought
    if chunk.logprobs is not None:  # the final record's: every token's
        out["logprobs"] = [_ollama_logprob(token) for token in chunk.logprobs]
    out["done"] = chunk.done
    if chunk.done:
        out["done_reason"] = chunk.done_reason or "stop"
        out.update(stats(chunk))
    return out


def _ollama_logprob(token: dict[str, Any]) -> dict[str, Any]:
    """A token's logprobs as Ollama gives them: its text and log probability, and its
    alternatives the same way."""
    alternatives = [{"token": t["token"], "logprob": t["logprob"]} for t in token["top_logprobs"]]
    return {"token": token["token"], "logprob": token["logprob"], "top_logprobs": alternatives}


def calls_record(model: str, chunk: GenerateResponse) -> dict[str, Any]:
    """A streamed line with an answer's tool calls alone (before its final line)."""
    message = {"role": "assistant", "content": "", "tool_calls": made_calls(chunk)}
    return {
        "model": model,
        "created_at": timestamp(chunk.created_at),
        "message": message,
        "done": False,
    }


def empty_record(model: str, now: float, chat: bool, done_reason: str | None) -> dict[str, Any]:
    """A record with no text: a keep-alive line (not done), or the answer to a load or an
    unload (done, with its reason)."""
    out: dict[str, Any] = {"model": model, "created_at": timestamp(now)}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out["done"] = done_reason is not None
    if done_reason is not None:
        out["done_reason"] = done_reason
    return out


def line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def error_line(exc: GgufqError) -> bytes:
    return line(ollama_body(exc))


def shorten(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """Ollama's ``dimensions``: each vector cut to its first N values, normalized again."""
    if dimensions is None:
        return vectors
    out = []
    for vector in vectors:
        head = vector[:dimensions]
        norm = math.sqrt(sum(v * v for v in head)) or 1.0
        out.append([v / norm for v in head])
    return out

"""OpenAI's request bodies and response objects (chat completions, completions,
embeddings), and how their parameters become ggufq's options. Pure: no I/O.

Defaults follow OpenAI's (temperature 1, top_p 1), as Ollama's OpenAI layer does.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from api_client.gateway.errors import openai_body
from api_client.gateway.ollama_schema import shorten
from api_client.gateway.shapes import called, text_of, think_for_effort
from scheduler.errors import GgufqError, InvalidRequest
from scheduler.protocol import EmbedResponse, GenerateResponse

FINGERPRINT = "fp_ggufq"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    logprobs: bool | int | None = None

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
        }
        limit = self._max_tokens()
        if limit is not None:
            out["num_predict"] = limit
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        for name in ("seed", "frequency_penalty", "presence_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out | self._logprob_options()

    def _logprob_options(self) -> dict[str, Any]:
        """Completions' ``logprobs``: how many alternatives each token comes with."""
        if self.logprobs is None or self.logprobs is False:
            return {}
        return {"top_logprobs": int(self.logprobs)}

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def turn(self) -> dict[str, Any]:
        """As a job carries it (a tool's answer is named after its call by the job)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            out["tool_calls"] = [called(c) for c in self.tool_calls]
        if self.role == "tool":
            if self.name:
                out["tool_name"] = self.name
            if self.tool_call_id:
                out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        return text_of(self.content, "message content")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}, as some clients send it

    def think_fields(self) -> dict[str, Any]:
        """``reasoning_effort`` as the job's ``think`` (shapes.think_for_effort)."""
        return think_for_effort(self.reasoning_effort or (self.reasoning or {}).get("effort"))

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def _logprob_options(self) -> dict[str, Any]:
        """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (its alternatives)."""
        return {"top_logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def turns(self) -> list[dict[str, Any]]:
        return [m.turn() for m in self.messages]

    def tool_fields(self) -> dict[str, Any]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a job carries them."""
        if not self.tools and self.tool_choice in (None, "auto", "none"):
            return {}  # nothing offered (a choice that needs tools is refused by the job)
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, dict):
                raise InvalidRequest(
                    f"tool_choice {choice!r} is not understood: send 'auto', 'none', "
                    "'required' or {'type': 'function', 'function': {'name': ...}}"
                )
            choice = {"name": function.get("name")}
        parallel = True if self.parallel_tool_calls is None else self.parallel_tool_calls
        tools = self.tools or []
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}

    def job_format(self) -> Literal["json"] | dict[str, Any] | None:
        """response_format → ggufq's format: json_object → "json", json_schema → its schema."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return "json"
        schema = (fmt.get("json_schema") or {}).get("schema")
        if kind == "json_schema" and isinstance(schema, dict):
            return schema
        raise InvalidRequest(
            f"response_format {fmt!r} is not supported: use type 'text', 'json_object', or "
            "'json_schema' with a 'json_schema': {'name': ..., 'schema': {...}}"
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] = ""
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = None

    def text(self) -> str:
        if self.suffix:
            raise InvalidRequest("'suffix' is not supported by ggufq: put the text in the prompt")
        if self.echo or self.best_of not in (None, 1):
            raise InvalidRequest("'echo' and 'best_of' are not supported by ggufq: leave them out")
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidRequest(
                f"prompt is a list of {len(self.prompt)}: ggufq answers one prompt per request; "
                "send one request for each"
            )
        return self.prompt[0]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else list(self.input)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest(
                "input must be a string or a non-empty list of strings: token arrays are not "
                "supported by ggufq"
            )
        return [str(t) for t in texts]


def finish_reason(final: GenerateResponse) -> str:
    if final.tool_calls:
        return "tool_calls"
    return "length" if final.done_reason == "length" else "stop"


def calls_of(final: GenerateResponse) -> list[dict[str, Any]]:
    """The tool calls an answer made, in OpenAI's shape: arguments as JSON text."""
    return [
        {
            "id": call.id or f"call_{final.job_id}_{n}",
            "type": "function",
            "function": {
                "name": call.function.name,
                "arguments": json.dumps(call.function.arguments),
            },
        }
        for n, call in enumerate(final.tool_calls)
    ]


def chat_logprobs(final: GenerateResponse) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: every token's (none when not asked)."""
    return None if final.logprobs is None else {"content": final.logprobs, "refusal": None}


def text_logprobs(final: GenerateResponse) -> dict[str, Any] | None:
    """A completion choice's ``logprobs``, in the completions API's older shape: tokens,
    their log probabilities, their alternatives as token → log probability, and where
    each token begins in the text."""
    if final.logprobs is None:
        return None
    offsets, at = [], 0
    for token in final.logprobs:
        offsets.append(at)
        at += len(token["token"])
    return {
        "tokens": [t["token"] for t in final.logprobs],
        "token_logprobs": [t["logprob"] for t in final.logprobs],
        "top_logprobs": [
            {a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in final.logprobs
        ],
        "text_offset": offsets,
    }


def answer_message(final: GenerateResponse) -> dict[str, Any]:
    """A whole chat answer: its text (null when it only called tools), its thinking
    (``reasoning_content``) and its calls."""
    calls = calls_of(final)
    out: dict[str, Any] = {"role": "assistant", "content": final.response}
    if final.thinking:
        out["reasoning_content"] = final.thinking
    if calls:
        out.update(content=final.response or None, tool_calls=calls)
    return out


def usage(*finals: GenerateResponse) -> dict[str, Any]:
    """Tokens of the answer's choices: the prompt once (as OpenAI counts it), the
    completions together; ``cached_tokens``: the prompt's found in the runner's cache."""
    prompt = max(final.prompt_eval_count or 0 for final in finals)
    completion = sum(final.eval_count or 0 for final in finals)
    cached = max(final.prompt_cached_count or 0 for final in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def envelope(kind: str, job_id: str, model: str, created: float) -> dict[str, Any]:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{job_id}",
        "object": kind,
        "created": int(created),
        "model": model,
        "system_fingerprint": FINGERPRINT,
    }


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every client skips it


def error_event(exc: GgufqError) -> bytes:
    return b"event: error\n" + event(openai_body(exc, 500))


def vector(values: list[float], encoding: str) -> list[float] | str:
    """float: the list as is; base64: little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
    return values


def chat_completion(job_id: str, model: str, finals: list[GenerateResponse]) -> dict[str, Any]:
    """A whole chat completion: one choice per final record."""
    choices = [
        {
            "index": index,
            "message": answer_message(final),
            "logprobs": chat_logprobs(final),
            "finish_reason": finish_reason(final),
        }
        for index, final in enumerate(finals)
    ]
    head = envelope("chat.completion", job_id, model, finals[0].created_at)
    return {**head, "choices": choices, "usage": usage(*finals)}


def text_completion(job_id: str, model: str, finals: list[GenerateResponse]) -> dict[str, Any]:
    """A whole (legacy) completion: one choice per final record."""
    choices = [
        {
            "text": final.response,
            "index": index,
            "logprobs": text_logprobs(final),
            "finish_reason": finish_reason(final),
        }
        for index, final in enumerate(finals)
    ]
    head = envelope("text_completion", job_id, model, finals[0].created_at)
    return {**head, "choices": choices, "usage": usage(*finals)}


def embedding_list(body: EmbeddingRequest, result: EmbedResponse) -> dict[str, Any]:
    """The embeddings answer: one vector per input, cut to ``dimensions`` if asked."""
    vectors = shorten(result.embeddings, body.dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": vector(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = result.prompt_eval_count
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }

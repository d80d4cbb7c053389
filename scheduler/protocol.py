"""The wire format of a job: typed, validated, JSON only.

Field names follow Ollama's API wherever Ollama has the field, so that people who know
Ollama know this. Shared by the client (validates before submitting), the placement
service and the workers (validate again on receipt: nothing trusts the wire).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from scheduler.bounds import MAX_STOP_CHARS, check_input, check_schema, input_chars
from scheduler.errors import InvalidRequest, shown
from scheduler.midstream import Resumed
from scheduler.names import check_model_name
from scheduler.thinking import Think
from scheduler.tooluse import MAX_TOOLS, TOOL_NAME, MessageToolCall, Tool, ToolChoice, check_choice
from scheduler.units import parse_duration_s


@dataclass(frozen=True)
class RunnerConfig:
    """What a runner is loaded with. A job can share a runner only if these match, except
    num_parallel: it sizes a new runner, and binds only a job that asks for it explicitly."""

    num_ctx: int  # context per sequence (Ollama's num_ctx)
    num_parallel: int = 1
    kv_type: str = "f16"
    flash_attn: bool = False
    n_batch: int = 512
    n_ubatch: int = 512
    swa_full: bool = False
    n_outputs: int = 0  # logits rows of the worst-case graph; 0 = llama.cpp's default (n_batch)
    embedding: bool = False  # an embedding runner: one slot, a batch as large as the context

    @classmethod
    def for_generation(cls, num_ctx: int, num_parallel: int, flash_attn: bool) -> RunnerConfig:
        """What placement loads for generation: the decode loop asks for one output row per
        sequence per step, so the context needs no more (Gemma 3's compute buffer at
        8192 × 4 drops from 514 to 30 MiB)."""
        return cls(num_ctx, num_parallel, flash_attn=flash_attn, n_outputs=num_parallel)

    @classmethod
    def for_embedding(cls, num_ctx: int, flash_attn: bool) -> RunnerConfig:
        """llama.cpp embeds an input in one batch: the batch is as large as the context."""
        return cls(
            num_ctx=num_ctx,
            num_parallel=1,
            flash_attn=flash_attn,
            n_batch=num_ctx,
            n_ubatch=num_ctx,
            embedding=True,
        )

    def key(self) -> str:
        """What must match for a job to share a runner (num_parallel aside)."""
        fields = asdict(self)
        del fields["num_parallel"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]


class Options(BaseModel):
    """Per-request model and sampling options (Ollama's names and meanings)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("num_ctx", mode="before")
    @classmethod
    def _at_least_4(cls, value: Any) -> Any:
        # Ollama raises a context below 4 tokens to 4 instead of refusing it
        return 4 if isinstance(value, int) and not isinstance(value, bool) and value < 4 else value

    num_ctx: int | None = Field(
        None, ge=4, le=1_048_576, description="context tokens per slot (below 4: 4, as Ollama)"
    )
    num_parallel: int | None = Field(
        None, ge=1, le=256, description="slots of a new runner; set: only such a runner serves"
    )
    num_predict: int = Field(-1, ge=-2, le=1_048_576, description="-1 = until the context is full")
    temperature: float = Field(0.8, ge=0.0, le=10.0)
    top_k: int = Field(40, ge=0, le=1_000_000)
    top_p: float = Field(0.9, ge=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.1, ge=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=-1, le=1_048_576)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int = Field(-1, ge=-1, le=2**32 - 1, description="-1 = random")
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=16
    )
    num_gpu: int = Field(-1, ge=-1, le=10_000, description="layers on GPU; -1 = as many as fit")
    main_gpu: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="load a new runner on a host's GPU of this index when it fits there "
        "(None: wherever the placement policy puts it)",
    )
    num_thread: int = Field(0, ge=0, le=1024, description="0 = worker default")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="each token's log probability and this many others"
    )


class Message(BaseModel):
    """One chat message (Ollama's /api/chat)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field("", max_length=4_000_000)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant
    tool_name: str | None = Field(None, pattern=TOOL_NAME)  # a tool's answer: whose it is
    tool_call_id: str | None = Field(None, max_length=128)  # ... the call it answers
    thinking: str | None = Field(None, max_length=4_000_000)  # assistant: not shown again

    @property
    def chars(self) -> int:
        """Its text's characters, the arguments of its calls (as JSON) included."""
        calls = self.tool_calls or []
        arguments = sum(len(json.dumps(c.function.arguments)) for c in calls)
        return len(self.content) + len(self.thinking or "") + arguments


class JobRequest(BaseModel):
    """One job as it travels client → placement → worker."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    kind: Literal["generate", "embed", "chat"] = "generate"
    model: str
    prompt: str = Field("", max_length=4_000_000)
    messages: list[Message] = Field(
        default_factory=list, max_length=10_000, description="chat: the conversation so far"
    )
    input: list[str] = Field(
        default_factory=list, max_length=4096, description="embed: the texts to embed"
    )
    truncate: bool = Field(False, description="cut what the context cannot hold, not refuse it")
    tools: list[Tool] = Field(
        default_factory=list, max_length=MAX_TOOLS, description="chat: tools the model may call"
    )
    tool_choice: ToolChoice = Field(
        "auto", description='"auto", "none", "required", or {"name": ...}: that tool\'s call'
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call an answer")
    think: Think = Field(
        None,
        description="chat: true (or low/medium/high) to think first, false not to; None: "
        "the model's default. Thinking comes apart from the answer.",
    )
    options: Options = Field(default_factory=Options)
    format: Literal["json"] | dict[str, Any] | None = Field(
        None, description='"json" or a JSON schema: constrain the output through a grammar'
    )
    keep_alive_s: float | None = Field(
        None, description="None keeps the runner's current value; 0 unloads after; <0 never"
    )
    priority: Literal["interactive", "batch"] = "interactive"
    tenant: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.:@-]{1,128}$",
        description="whom the job is for: an API key's id, else the client's name, else default",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="the tenant's share: with weight 2 it is served twice as often as a "
        "tenant of weight 1 while both have jobs waiting",
    )
    replicas: int = Field(
        0,
        ge=0,
        le=64,
        description="a load (empty prompt): load replicas of the model until this many run",
    )
    device: str | None = Field(
        None, min_length=1, max_length=256, description="pin to this device id"
    )
    submitted_at: float = Field(default_factory=time.time)
    attempt: int = Field(0, ge=0, le=1, description="1 once re-placed after its worker died")
    avoid: list[str] = Field(
        default_factory=list, max_length=16, description="devices its load failed on"
    )
    resumed: list[Resumed] = Field(
        default_factory=list, max_length=16, description="each time it went on elsewhere"
    )

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        return check_model_name(value)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("format")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if isinstance(value, dict):
            check_schema(value)
        return value

    @property
    def chars(self) -> int:
        """The characters of its text: prompt, messages and inputs together."""
        tools = sum(len(json.dumps(t.function.model_dump())) for t in self.tools)
        return (
            input_chars(self.prompt, [], self.input) + sum(m.chars for m in self.messages) + tools
        )

    @model_validator(mode="after")
    def _embed_has_input(self) -> JobRequest:
        check_input(self.chars)
        if self.kind == "embed" and not self.input:
            raise ValueError("an embed job needs input: one text or a list of texts")
        if self.kind == "chat" and not self.messages:
            raise ValueError("a chat job needs messages: [{'role': 'user', 'content': ...}]")
        check_choice(self.tools, self.tool_choice, self.kind, self.format)
        if self.think and self.kind != "chat":
            raise ValueError("think works on chats: send messages (the chat template thinks)")
        return self

    @field_validator("keep_alive_s", mode="before")
    @classmethod
    def _keep_alive(cls, value: Any) -> float | None:
        return None if value is None else parse_duration_s(value)


def parse_request(data: dict[str, Any]) -> JobRequest:
    """Validate a job, turning pydantic's error into one that names field and allowed range."""
    try:
        return JobRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "request"
        got = err.get("input")
        msg = err["msg"]
        ctx = err.get("ctx") or {}
        if isinstance(ctx.get("error"), Exception):
            msg = str(ctx["error"])
        parts.append(f"{field}: {msg} (got {shown(got)})")
    return "invalid request: " + "; ".join(parts)


DoneReason = Literal["stop", "length", "error", "cancel", "load", "unload"]


class EmbedResponse(BaseModel):
    """The result of an embed job (Ollama's /api/embed fields)."""

    model: str
    job_id: str
    embeddings: list[list[float]]
    prompt_eval_count: int = 0
    total_duration: int | None = None
    load_duration: int | None = None
    device: str | None = None


class GenerateResponse(BaseModel):
    """A streamed chunk, or (done=True) the final record with Ollama's stats."""

    model: str
    job_id: str
    created_at: float
    response: str = ""
    thinking: str = ""  # thinking text (a chunk's, or the whole of it in the final record)
    logprobs: list[dict[str, Any]] | None = None  # final record: each token's, when asked
    done: bool = False
    done_reason: DoneReason | None = None
    stop_sequence: str | None = None  # final record: the stop string that ended it
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_cached_count: int | None = None  # of those, found in the slot's cache
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    device: str | None = None
    message: Message | None = None  # chat: the assistant's answer (the final record)
    warnings: list[str] = Field(default_factory=list)
    resumed: list[Resumed] = Field(default_factory=list)  # final record: where it went on
    error: dict[str, str] | None = None
    seq: int | None = None  # a streamed chunk's place in its job's stream (1, 2, ...)

    @property
    def tool_calls(self) -> list[MessageToolCall]:
        """The tools the answer called (none: a plain answer)."""
        return list(self.message.tool_calls or []) if self.message is not None else []


class Placement(BaseModel):
    """Where placement sent a job: the record that travels with it to the worker.

    ``device_ids`` lists every device the runner's memory is reserved on (several when the
    model spans GPUs, with ``split_blocks`` blocks on each, in layer order, for llama.cpp's
    tensor_split); ``n_gpu_layers`` is llama.cpp's (0 on the CPU).
    """

    # fields added by a newer version are ignored, so that a rolling upgrade never strands a job
    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(description="this placement of the job; a re-placement gets a new one")
    runner_id: str
    device_id: str
    device_ids: list[str] = Field(default_factory=list)
    split_blocks: list[int] = Field(default_factory=list)
    n_gpu_layers: int = 0
    config: RunnerConfig
    warnings: list[str] = Field(default_factory=list)
    placement_ns: int = 0

    @property
    def devices(self) -> list[str]:
        """Every device the runner's memory is reserved on."""
        return list(self.device_ids or [self.device_id])


class SentJob(BaseModel):
    """A job sent to a device's queue, as recorded before sending (``ggufq:inflight:<device>``):
    if the device is dropped, placement finds the job there and re-places or fails it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    job: JobRequest
    placement: Placement
    worker: str
    sent_at: float = 0.0
    avoid: list[str] = Field(default_factory=list, description="devices its load failed on")
    lost: str = Field("", description="why its run was lost, when not its device's silence")

    @classmethod
    def parse(cls, raw: bytes | str) -> SentJob | None:
        """The record ``raw`` holds, or None when it does not parse (hand-written, or
        another version's): whoever reads one leaves it to the reap."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError:
            return None


def parse_placement(data: dict[str, Any]) -> Placement:
    """Validate the placement record a worker receives with a job."""
    try:
        return Placement.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(
            describe_validation_error(exc).replace("request", "placement", 1)
        ) from None

"""A batch's input lines (OpenAI's Batch API shape), checked up front, put in the order that
runs them fastest, and the lines of its output and error files. Pure: bytes in, values out.

An input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}``; its body is what that endpoint takes, without ``stream``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api_client.batches.states import ENDPOINTS
from api_client.gateway.core import model_name, parse_body
from api_client.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from scheduler.errors import GgufqError

# each endpoint's request body, as that endpoint validates it
BODIES: dict[str, type[Any]] = dict(
    zip(ENDPOINTS, (ChatCompletionRequest, CompletionRequest, EmbeddingRequest), strict=True)
)
_ORDER_KEY_CHARS = 4096  # lines whose text agrees this far run side by side


@dataclass(frozen=True, slots=True)
class Line:
    index: int  # 0-based, among the file's lines that are not blank
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    line: int  # 1-based, as an editor shows it
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def read_lines(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[LineError]]:
    """The lines of an input file for a batch of ``endpoint``, and every problem found in it
    (a batch with any problem fails as a whole, as OpenAI's does)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            errors.append(
                LineError(number, "too_many_lines", f"a batch takes at most {max_lines:,} lines")
            )
            break
        line, problem = _read_line(raw, number, endpoint)
        if problem is None and line is not None and line.custom_id in seen:
            problem = LineError(
                number,
                "duplicate_custom_id",
                f"custom_id {line.custom_id!r} is used twice",
                "custom_id",
            )
        if problem is not None:
            errors.append(problem)
        elif line is not None:
            seen.add(line.custom_id)
            lines.append(Line(len(lines), line.custom_id, line.body))
    if not lines and not errors:
        errors.append(LineError(1, "empty_file", "the input file holds no request lines"))
    return lines, errors


def _read_line(raw: bytes, number: int, endpoint: str) -> tuple[Line | None, LineError | None]:
    def error(code: str, message: str, param: str | None = None) -> tuple[None, LineError]:
        return None, LineError(number, code, message, param)

    try:
        item = json.loads(raw)
    except ValueError:
        return error("invalid_json_line", "this line is not valid JSON")
    if not isinstance(item, dict):
        return error("invalid_json_line", "a line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return error(
            "missing_required_parameter",
            "custom_id must be a string of 1 to 512 characters",
            "custom_id",
        )
    if item.get("method", "POST") != "POST":
        return error("invalid_method", "method must be POST", "method")
    if item.get("url") != endpoint:
        return error(
            "mismatched_endpoint",
            f"url {item.get('url')!r} is not the batch's endpoint {endpoint!r}",
            "url",
        )
    body = item.get("body")
    if not isinstance(body, dict):
        return error("missing_required_parameter", "body must be a JSON object", "body")
    if body.get("n") not in (None, 1):
        return error("invalid_parameter", "a batch's request asks for one choice (n 1)", "body.n")
    if body.get("stream"):
        return error("invalid_parameter", "a batch's requests cannot stream", "body.stream")
    try:
        model_name(body.get("model"))
        parse_body(BODIES[endpoint], body)
    except GgufqError as exc:
        return error("invalid_request", exc.message, "body")
    return Line(0, custom_id, body), None


def order_key(line: Line) -> tuple[str, str]:
    """What puts lines that share a prompt's beginning (a system prompt, a long shared
    prefix) next to each other: the model, then the text as the model reads it."""
    body = line.body
    text = body.get("prompt") or body.get("input") or ""
    if "messages" in body:
        text = "\0".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    if not isinstance(text, str):
        text = json.dumps(text)
    return str(body.get("model", "")), text[:_ORDER_KEY_CHARS]


def run_order(lines: list[Line]) -> list[Line]:
    """The lines in the order they are sent: sorted by :func:`order_key` (stable), so the
    prompt cache of a runner serves a shared prefix once for a run of lines."""
    return sorted(lines, key=order_key)


def output_line(line: Line, job_id: str, status: int, body: Any) -> dict[str, Any]:
    """One line of the output file (status 200) or of the error file (the request failed)."""
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": job_id, "body": body},
        "error": None,
    }


def unrun_line(line: Line, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that never ran (expired, or cancelled)."""
    return {
        "id": f"batch_req_unrun_{line.index}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def lost_line(lines: list[Line], index: int) -> dict[str, Any]:
    """A line of the error file for an answer written where this process cannot read it."""
    custom_id = lines[index].custom_id if index < len(lines) else f"line {index + 1}"
    return {
        "id": f"batch_req_lost_{index}",
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "answer_lost",
            "message": "its answer was kept in GGUFQ_DATA_DIR/spool by a gateway process "
            "whose files this one cannot read: gateways must share GGUFQ_DATA_DIR",
        },
    }

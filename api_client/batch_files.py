"""A batch's rows: its inputs (prompts, chats, a JSONL file), the output file a run
resumes from, and the summary of where it stands."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.errors import GgufqError, InvalidRequest
from scheduler.protocol import GenerateResponse

BatchInput = str | Path | Iterable[str | Mapping[str, Any]]


@dataclass
class BatchSummary:
    """Where a batch stands; ``on_progress`` gets it after each row, ``batch()`` returns it.

    ``rows`` holds the rows of this run in input order when there is no output file (with
    one, the rows are in the file). ``tokens`` counts generated tokens of this run.
    """

    total: int
    done: int = 0
    failed: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0
    output: str | None = None
    first_error: str = ""  # the first failed row's error, to tell in one line
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def finished(self) -> int:
        """Rows accounted for: done, failed or skipped (already in the output)."""
        return self.done + self.failed + self.skipped

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "skipped": self.skipped,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "output": self.output,
        }


@dataclass
class Row:
    """One input row: its id, a prompt or a conversation, and its own options."""

    index: int
    id: Any
    prompt: str | None = None
    messages: list[Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # why it cannot run; it fails in its row, the batch goes on

    @property
    def input(self) -> Any:
        return self.messages if self.messages is not None else self.prompt


def read_rows(inputs: BatchInput) -> list[Row]:
    """Rows from a list of prompts, a list of dicts, or a JSONL file (a path).

    An id defaults to the row's 0-based index (blank lines of a file are not rows).
    Raises InvalidRequest for unreadable input and for duplicate ids.
    """
    if isinstance(inputs, str | Path):
        items, where = _read_jsonl(Path(inputs)), f"{inputs}: row"
    else:
        items, where = list(inputs), "input row"
    rows = [_row(index, item, where) for index, item in enumerate(items)]
    seen: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    for row in rows:
        key = str(row.id)
        if key in seen:
            duplicates.setdefault(key, [seen[key]]).append(row.index)
        seen.setdefault(key, row.index)
    if duplicates:
        named = "; ".join(f"{k!r} at rows {v}" for k, v in list(duplicates.items())[:10])
        more = f" (and {len(duplicates) - 10} more)" if len(duplicates) > 10 else ""
        raise InvalidRequest(
            f"duplicate ids in the batch: {named}{more}; every row needs its own id "
            "(rows without one get their 0-based index)"
        )
    return rows


def _read_jsonl(path: Path) -> list[Any]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 text at byte {exc.start}"
        raise InvalidRequest(
            f"cannot read the batch input {str(path)!r}: {why}; give a JSONL file "
            'with one {"prompt": ...} or {"messages": [...]} per line, or a list of prompts'
        ) from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidRequest(
                f"{path}:{number}: not JSON ({exc.msg}); each line must be one JSON object "
                'such as {"id": "q1", "prompt": "..."}'
            ) from None
    return items


def _row(index: int, item: Any, where: str) -> Row:
    if isinstance(item, str):
        return Row(index, str(index), prompt=item)
    if not isinstance(item, Mapping):
        raise InvalidRequest(
            f"{where} {index} is {type(item).__name__}; a row is a prompt string or an object "
            'with "prompt" or "messages" (and optional "id", "options")'
        )
    row = Row(index, item.get("id", str(index)))
    if row.id is None or isinstance(row.id, dict | list):
        raise InvalidRequest(f"{where} {index}: id must be a string or a number, got {row.id!r}")
    prompt, messages, options = item.get("prompt"), item.get("messages"), item.get("options")
    if (prompt is None) == (messages is None):
        row.problem = 'a row needs exactly one of "prompt" (a string) or "messages" (a list)'
    elif prompt is not None and not isinstance(prompt, str):
        row.problem = f'"prompt" must be a string, got {type(prompt).__name__}'
    elif messages is not None and not isinstance(messages, list):
        row.problem = f'"messages" must be a list of {{"role", "content"}}, got {messages!r}'
    elif options is not None and not isinstance(options, Mapping):
        row.problem = f'"options" must be an object, got {options!r}'
    row.prompt = prompt if isinstance(prompt, str) else None
    row.messages = messages if isinstance(messages, list) else None
    if row.prompt is None and row.messages is None:
        row.prompt = "" if prompt is None else str(prompt)
    row.options = dict(options) if isinstance(options, Mapping) else {}
    return row


_STATS = (
    "done_reason",
    "eval_count",
    "prompt_eval_count",
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
)


def result_row(
    row: Row, result: GenerateResponse | None, error: GgufqError | None
) -> dict[str, Any]:
    """A row of the results file: ``id``, ``input``, ``response`` and ``stats``, or ``error``."""
    out: dict[str, Any] = {"id": row.id, "input": row.input}
    if result is not None:
        text = result.message.content if result.message is not None else result.response
        out.update(response=text, stats={n: getattr(result, n) for n in _STATS}, error=None)
    else:
        assert error is not None
        error_fields = {"code": error.code, "message": str(error)}
        out.update(response=None, stats=None, error=error_fields)
    return out


def check_output(path: Path) -> None:
    """Refuse an output path that cannot be the results file."""
    if path.is_dir():
        raise InvalidRequest(
            f"the batch output {str(path)!r} is a directory; name a file in it, such as "
            f"{str(path / 'results.jsonl')!r}"
        )


def finished_ids(path: Path) -> set[str]:
    """Ids of the complete rows of an output file; a torn last line (the writer was killed
    mid-row) is cut off so that appending starts on a fresh line."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    ids: set[str] = set()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            if line.strip():
                break
        good += len(line)
    if good < len(data):
        with path.open("r+b") as f:
            f.truncate(good)
    return ids

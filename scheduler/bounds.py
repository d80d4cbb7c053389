"""How much one job may ask for, so that no single request can take the cluster down: its
text travels through about five Redis records, and its JSON schema becomes a grammar built
in pure Python inside a worker, in memory that grows with the numbers the schema holds (a
``minItems`` of 100,000,000 grew a worker by 2 GiB in 5.6 s). Every process that validates
a job (the client, the gateway, placement, the worker) refuses what is over these with
:class:`InvalidRequest`, naming the limit. Pure."""

from __future__ import annotations

import json
import re
from typing import Any

from scheduler.errors import InvalidRequest

MAX_INPUT_CHARS = 4_000_000  # a job's prompt, messages and embed inputs together
MAX_STOP_CHARS = 1_000  # each stop string
MAX_SCHEMA_BYTES = 64 << 10  # a JSON schema, as JSON
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a schema
MAX_SCHEMA_COUNT = 1_024  # minItems, maxLength, ... and a pattern's {n,m}
_COUNTS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
)
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def input_chars(prompt: str, contents: list[str], inputs: list[str]) -> int:
    """The characters of a job's text, all together."""
    return len(prompt) + sum(map(len, contents)) + sum(map(len, inputs))


def check_input(chars: int) -> None:
    if chars > MAX_INPUT_CHARS:
        raise InvalidRequest(
            f"the job's text is {chars:,} characters (prompt, messages and inputs together); "
            f"a job takes at most {MAX_INPUT_CHARS:,}: split it into several jobs"
        )


def check_schema(schema: dict[str, Any], where: str = "format") -> None:
    """Refuse a JSON schema whose grammar could be too large to build: over
    MAX_SCHEMA_BYTES as JSON, nested deeper than MAX_SCHEMA_DEPTH, or with a count (or a
    pattern's repetition) over MAX_SCHEMA_COUNT. ``where`` names it in the error."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{where}: the JSON schema is {size:,} bytes; at most {MAX_SCHEMA_BYTES:,} are "
            "taken: describe the output more compactly"
        )
    _walk(schema, where, 0)


def _walk(node: Any, where: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(
            f"{where}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it"
        )
    if isinstance(node, list):
        for n, item in enumerate(node):
            _walk(item, f"{where}[{n}]", depth + 1)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _COUNTS and isinstance(value, int) and value > MAX_SCHEMA_COUNT:
            _too_many(f"{where}.{key}", value)
        if key == "pattern" and isinstance(value, str):
            for found in _REPEAT.finditer(value):
                for number in found.groups():
                    if number and int(number) > MAX_SCHEMA_COUNT:
                        _too_many(f"{where}.pattern's {found.group(0)}", int(number))
        _walk(value, f"{where}.{key}", depth + 1)


def _too_many(where: str, value: int) -> None:
    raise InvalidRequest(
        f"{where} is {value:,}; a schema's counts are at most {MAX_SCHEMA_COUNT:,} (the "
        "grammar built from it grows with them): lower it, or leave it out and check the "
        "output's length after"
    )

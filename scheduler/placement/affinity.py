"""Which runner last served a prompt's leading part. Pure: no I/O, no clock.

A runner's slot keeps the KV cache of the sequence it served last, so a conversation's
next turn evaluates only its new tokens on the runner (and slot) that served the turn
before. Placement keys a job by a hash of its prompt's start (or of a chat's first
messages, which every later turn repeats), remembers the runner that served that key, and
passes it to the decision as ``JobNeeds.affine``; the decision prefers that runner while
it has a free slot (branch 3b).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from hashlib import blake2b
from typing import Protocol

from scheduler.protocol import JobRequest

PREFIX_CHARS = 256


class ChatMessage(Protocol):
    """A chat message as :class:`scheduler.protocol.Message` has it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def prefix_key(text: str, *, chars: int = PREFIX_CHARS, scope: str = "") -> str:
    """A short hash of the first ``chars`` characters of ``text`` (within ``scope``, e.g.
    the model, so that one prompt sent to two models keeps two entries)."""
    digest = blake2b(digest_size=8)
    digest.update(scope.encode())
    digest.update(b"\0")
    digest.update(text[:chars].encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def chat_key(messages: Iterable[ChatMessage], *, chars: int = PREFIX_CHARS, scope: str = "") -> str:
    """The key of a conversation: its system messages and first user message, each cut to
    ``chars`` characters, which every later turn of the conversation repeats unchanged.
    Several conversations behind one long system prompt still get keys of their own."""
    parts = []
    for message in messages:
        parts.append(f"{message.role}:{message.content[:chars]}")
        if message.role == "user":
            break
    return prefix_key("\0".join(parts), chars=len(parts) * (chars + 16), scope=scope)


class AffinityMap:
    """A bounded map key → runner id, least recently used entries dropped first."""

    def __init__(self, max_size: int = 10_000) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.max_size = max_size
        self._runner: OrderedDict[str, str] = OrderedDict()
        self._keys: dict[str, set[str]] = {}  # runner id → its keys

    def get(self, key: str) -> str | None:
        runner_id = self._runner.get(key)
        if runner_id is not None:
            self._runner.move_to_end(key)
        return runner_id

    def put(self, key: str, runner_id: str) -> None:
        self._drop(key)
        self._runner[key] = runner_id
        self._keys.setdefault(runner_id, set()).add(key)
        while len(self._runner) > self.max_size:
            self._drop(next(iter(self._runner)))

    def forget_runner(self, runner_id: str) -> int:
        """Drop every key that points at ``runner_id`` (it unloaded); returns how many."""
        keys = self._keys.pop(runner_id, set())
        for key in keys:
            del self._runner[key]
        return len(keys)

    def __len__(self) -> int:
        return len(self._runner)

    def __contains__(self, key: object) -> bool:
        return key in self._runner

    def _drop(self, key: str) -> None:
        runner_id = self._runner.pop(key, None)
        if runner_id is None:
            return
        keys = self._keys[runner_id]
        keys.discard(key)
        if not keys:
            del self._keys[runner_id]


def job_key(req: JobRequest) -> str:
    """The key of a job's prompt prefix ("" for jobs without one: loads, embeddings)."""
    if req.kind == "chat":
        return chat_key(req.messages, scope=req.model)
    if req.kind == "generate" and req.prompt:
        return prefix_key(req.prompt, scope=req.model)
    return ""

"""A model's tool calls, read out of the text it wrote (issue 35's recognisers).

Models write their calls in a handful of formats, each its model family's own:

- Hermes / Qwen: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one block per
  call, text around them;
- Llama 3.x: the whole answer is ``{"name": …, "parameters": {…}}`` (or several, ``;``
  apart), or ``<|python_tag|>`` then such JSON, ending at ``<|eom_id|>``;
- Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3), or then
  ``name[ARGS]{…}`` per call (the 2025 templates);
- generic JSON, for a template that has no place for tools (the gateway describes them in a
  system message and asks for this): the whole answer is ``{"tool_calls": [{"name",
  "arguments"}]}`` or one ``{"name", "arguments"}`` object, perhaps in a ```json fence.

:func:`recognise` reads a whole answer; :class:`ToolCallStream` sits on a stream of text
deltas and passes on only what is surely content, holding back what may begin a call, so a
call's markup is never shown as text. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# what may open a call, in any format: held back from a stream until it is known not to
MARKERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Recognised:
    """An answer read: its text without the calls' markup, and the calls in order (none: a
    plain answer). ``malformed`` names markup that opened a call that does not parse."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: str = ""


def _call(raw: Any, names: frozenset[str] | None) -> ToolCall | None:
    """A call from its decoded JSON: a name and an object of arguments (``arguments``, or
    Llama's ``parameters``; JSON text of one is decoded), the name among ``names`` if given."""
    if not isinstance(raw, dict):
        return None
    if isinstance(raw.get("function"), dict):  # OpenAI's own shape, echoed by some models
        raw = raw["function"]
    name = raw.get("name")
    args = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    if names is not None and name not in names:
        return None
    return ToolCall(name, args)


def _calls(raws: list[Any], names: frozenset[str] | None) -> tuple[ToolCall, ...] | None:
    calls = [_call(raw, names) for raw in raws]
    return None if not calls or None in calls else tuple(c for c in calls if c is not None)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (``;``, ``,`` or space apart), or
    None when it holds anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past Python's
            return None
        values.append(value)
        at = end
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
    return values


def _hermes(text: str, names: frozenset[str] | None) -> Recognised | None:
    if "<tool_call>" not in text:
        return None
    raws = []
    for block in _HERMES.findall(text):
        values = _json_values(block)
        if values is None or len(values) != 1:
            return Recognised(text, malformed=f"<tool_call>{block}")
        raws.append(values[0])
    calls = _calls(raws, names)
    if calls is None:
        return Recognised(text, malformed="<tool_call> names no tool offered")
    content = _HERMES.sub("", text).strip()
    return Recognised(content, calls)


def _mistral(text: str, names: frozenset[str] | None) -> Recognised | None:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:
        return None
    after = after.replace("</s>", "").strip()
    if "[ARGS]" in after:  # name[ARGS]{...} per call, each after its own [TOOL_CALLS]
        raws = []
        for part in after.split("[TOOL_CALLS]"):
            match = _MISTRAL_ARGS.match(part)
            values = _json_values(part[match.end() :]) if match else None
            if match is None or values is None or len(values) != 1:
                return Recognised(text, malformed=f"[TOOL_CALLS]{part}")
            raws.append({"name": match.group(1), "arguments": values[0]})
    else:
        values = _json_values(after)
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return Recognised(text, malformed=f"[TOOL_CALLS]{after}")
        raws = values[0]
    calls = _calls(raws, names)
    if calls is None:
        return Recognised(text, malformed="[TOOL_CALLS] names no tool offered")
    return Recognised(before.strip(), calls)


def _llama(text: str, names: frozenset[str] | None) -> Recognised | None:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body.removeprefix("<|python_tag|>").split("<|eom_id|>")[0].strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return Recognised(text, malformed=f"<|python_tag|>{body}") if tagged else None
    values = _json_values(body)
    if values is None:
        return Recognised(text, malformed=body) if tagged else None
    if len(values) == 1 and isinstance(values[0], dict) and "tool_calls" in values[0]:
        values = values[0]["tool_calls"]  # the generic form
    elif len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    if not isinstance(values, list):
        return None
    calls = _calls(values, names)
    if calls is None:
        # JSON that is no call is an answer (a model asked for JSON output writes JSON)
        return Recognised(text, malformed=body) if tagged else None
    return Recognised("", calls)


def recognise(text: str, names: frozenset[str] | None = None) -> Recognised:
    """The tool calls in a whole answer, in whichever format it wrote them; ``names``, when
    given, are the tools offered (a call of another is no call). Plain text is content."""
    for reader in (_hermes, _mistral, _llama):
        found = reader(text, names)
        if found is not None:
            return found
    return Recognised(text)


@dataclass
class ToolCallStream:
    """Text deltas in, content deltas out, calls at the end: what may begin a call is held
    back (a marker's first characters, or an answer that opens with ``{``, ``[`` or a
    fence) until it is known to be text or the answer ends. ``shown`` is all the content
    passed on; ``malformed`` names markup that opened a call that did not parse (its text
    is then content)."""

    names: frozenset[str] | None = None
    shown: str = ""
    malformed: str = ""
    calls: tuple[ToolCall, ...] = field(default=())
    _text: str = ""
    _sent: int = 0  # characters of _text passed on as content
    _held: bool = False  # a call has begun: nothing more is content until the end

    def feed(self, delta: str) -> str:
        """The content to show now (may be empty)."""
        self._text += delta
        if self._held:
            return ""
        text = self._text
        if self._sent == 0:  # nothing shown yet: blank space waits for what follows it
            if not text.strip():
                return ""
            if text.lstrip()[:1] in ("{", "[", "`"):
                self._held = True  # a whole-answer call, perhaps
                return ""
        for marker in MARKERS:
            at = text.find(marker, self._sent)
            if at >= 0:
                self._held = True
                return self._pass(at)
        # a marker's beginning at the end: wait for more before showing it
        keep = max(
            (n for m in MARKERS for n in range(1, len(m)) if text.endswith(m[:n])), default=0
        )
        return self._pass(len(text) - keep)

    def _pass(self, upto: int) -> str:
        out = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        self.shown += out
        return out

    def end(self, cut: bool = False) -> str:
        """The answer ended: the content not shown yet (none when it held calls); the calls
        are then in :attr:`calls`. ``cut``: it ended at its token limit, so a call it had
        begun is left out (named in :attr:`malformed`), not shown as text."""
        found = recognise(self._text, self.names)
        self.calls, self.malformed = found.calls, found.malformed
        held = self._text[self._sent :]
        if not found.calls and cut and self._held and (found.malformed or '"name"' in held):
            self.malformed = f"cut at the token limit: {held}"
            return ""
        if not found.calls:
            return self._pass(len(self._text))
        shown = self._text[: self._sent].strip()  # what came before the first call
        rest = found.content[len(shown) :] if found.content.startswith(shown) else ""
        self.shown += rest
        return rest

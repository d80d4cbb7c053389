"""What a model writes, parted as it streams: thinking, the answer's text, tool calls.

Each generated piece goes through the thinking splitter (when the model's template has a
thinking mode), then the tool-call reader (when the job offers tools), and what is surely
thinking or answer text is published at once; a tool call's markup and a tag are held back,
never published as text. At the end, :meth:`Answer.fields` gives the final record's parts
(a chat's ``message`` with them), and a call that did not parse becomes a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scheduler.protocol import JobRequest
from scheduler.thinking import ThinkSplitter
from scheduler.toolcalls import ToolCallStream
from scheduler.tooluse import MAX_TOOLS, offered


class Answer:
    """``publish`` takes each chunk ({"thinking": …} or {"response": …}); ``thinking`` is
    the splitter for a template that can think (None: no thinking mode); ``warnings`` the
    job's, which a call that did not parse joins."""

    def __init__(
        self,
        req: JobRequest,
        publish: Callable[[dict[str, Any]], None],
        thinking: ThinkSplitter | None = None,
        warnings: list[str] | None = None,
    ) -> None:
        tools = offered(req.tools, req.tool_choice)
        self.req, self.publish, self.thinking = req, publish, thinking
        self.warnings = [] if warnings is None else warnings
        self.calls = ToolCallStream(frozenset(t.function.name for t in tools)) if tools else None
        self._text: list[str] = []

    def __call__(self, piece: str) -> None:
        thought, said = self.thinking.feed(piece) if self.thinking else ("", piece)
        self._out(thought, said)

    def _out(self, thought: str, said: str) -> None:
        if thought:
            self.publish({"thinking": thought})
        if said and self.calls is not None:
            said = self.calls.feed(said)
        if said:
            self._text.append(said)
            self.publish({"response": said})

    def fields(self, text: str, cut: bool = False) -> dict[str, Any]:
        """The text has ended (``text``, all of it; ``cut``: at its token limit): what was
        held back is published, and the final record's ``response`` and ``thinking`` are
        returned, with a chat's ``message`` (its calls too)."""
        response, calls = text, []
        if self.thinking is not None:
            self._out(*self.thinking.end())
            response = "".join(self._text)
        if self.calls is not None:
            rest = self.calls.end(cut)
            if rest:
                self._text.append(rest)
                self.publish({"response": rest})
            response = "".join(self._text)
            calls = self._made()
        thought = self.thinking.thinking if self.thinking is not None else ""
        out: dict[str, Any] = {"response": response}
        message: dict[str, Any] = {"role": "assistant", "content": response}
        if calls:
            message["tool_calls"] = calls
        if thought:
            out["thinking"] = message["thinking"] = thought
        if self.req.kind == "chat":
            out["message"] = message
        return out

    def _made(self) -> list[dict[str, Any]]:
        """The calls the answer made (at most one unless parallel calls are allowed); one
        that did not parse is a warning."""
        assert self.calls is not None
        if self.calls.malformed:
            self.warnings.append(
                f"the model began a tool call that does not parse "
                f"({self.calls.malformed[:200]!r}): it is given as text, or left out when the "
                "answer was cut at num_predict; tool_choice 'required' makes the model write "
                "a valid call"
            )
        made = self.calls.calls[: MAX_TOOLS if self.req.parallel_tool_calls else 1]
        return [
            {
                "id": f"call_{self.req.id[:40]}_{n}",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for n, c in enumerate(made)
        ]

"""Tool-call deltas for streamed chat completions, the way OpenAI (and vLLM) send them.

Per choice, a `ToolStreamer` re-reads the text generated so far with its parser and sends what
is new since the last chunk: content text; a call's first delta carries its `index`, `id`,
`type` and `function.name` (arguments ""), later ones only `index` and an arguments fragment.
Concatenating a call's fragments gives its arguments JSON.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.server.tools.json_calls import PartialCall
from kvgate.engine.server.tools.parsers import Parsed, ToolParser


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def message_tool_calls(calls: list[PartialCall]) -> list[dict[str, Any]]:
    """`message.tool_calls` of a non-streamed answer."""
    return [
        {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


@dataclass
class _Sent:
    id: str
    arguments: str = ""


@dataclass
class ToolStreamer:
    parser: ToolParser
    max_calls: int | None = None  # parallel_tool_calls=false: only the first call
    content_sent: str = ""
    calls_sent: list[_Sent] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.calls_sent)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat `delta` for `text` (everything generated so far): {} when nothing is new."""
        parsed = self.parser.parse(text, final)
        out: dict[str, Any] = {}
        content = self._content(parsed)
        if content:
            out["content"] = content
        tool_deltas = self._calls(parsed.calls[: self.max_calls])
        if tool_deltas:
            out["tool_calls"] = tool_deltas
        return out

    def _content(self, parsed: Parsed) -> str:
        if not parsed.content.startswith(self.content_sent):
            return ""  # the parser changed its mind (malformed markup at the end): keep what was sent
        new = parsed.content[len(self.content_sent) :]
        self.content_sent = parsed.content
        return new

    def _calls(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls go out in order, each once its name is known
            if index == len(self.calls_sent):
                sent = _Sent(tool_call_id())
                self.calls_sent.append(sent)
                deltas.append(
                    {
                        "index": index,
                        "id": sent.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self.calls_sent[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                if deltas and deltas[-1]["index"] == index:  # the header just made: one entry per call
                    deltas[-1]["function"]["arguments"] = fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

"""Tool-call parsers: generated text → (content, calls), by `--tool-call-parser` name.

Every parser is a pure function of the text generated so far. `final=False` (streaming, text
still growing) returns the content that is certain (text that may turn out to open a tool call
is held back) and the calls as far as they go; `final=True` returns the finished answer, and
when the model's tool-call markup does not parse, the whole text as content and no calls (as
vLLM does): malformed model output is an answer without tool calls, never an error.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.engine.server.tools.json_calls import PartialCall, scan_call, skip_ws

__all__ = ["PARSERS", "Parsed", "ToolParser", "get_parser"]


@dataclass
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    name: ClassVar[str]

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes,
    Qwen2.5/3). Text before the first block is content; the last block may lack its end tag."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            if final:
                return Parsed(text)
            return Parsed(text[: len(text) - _partial_tag(text, self.START)])
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = scan_call(body, 0)
            if call is None or (call.complete and body[call.end :].strip()):
                return Parsed(text) if final else Parsed(text[:first], calls)
            calls.append(call)
            if end < 0:
                break
            pos = text.find(self.START, end + len(self.END))
        if final and not all(c.complete for c in calls):
            return Parsed(text)
        return Parsed(text[:first], calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`), several separated by `;`. An answer that does not start
    with one is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return Parsed("")  # empty so far, or maybe the tag still arriving
        if i >= len(text):
            return Parsed(text)
        if text[i] != "{":
            return Parsed(text)
        calls: list[PartialCall] = []
        while i < len(text):
            call = scan_call(text, i)
            if call is None:
                return Parsed(text) if final else Parsed("", calls)
            calls.append(call)
            if not call.complete:
                break
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                return Parsed(text) if final else Parsed("", calls)
        if final and not (calls and all(c.complete for c in calls)):
            return Parsed(text)
        return Parsed("", calls)


class PythonicParser(ToolParser):
    """`[get_weather(city="Paris"), f(x=1)]` (Llama 3.2/4 pythonic, Olmo), optionally inside
    `<|python_start|>...<|python_end|>`; keyword arguments with literal values only (read with
    `ast.literal_eval`, nothing runs). Calls are sent whole when the answer is finished."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START) :].removesuffix(self.END).strip()
        if not final:
            if not body or body.startswith("[") or self.START.startswith(body):
                return Parsed("")
            return Parsed(text)
        calls = _pythonic_calls(body)
        return Parsed(text) if calls is None else Parsed("", calls)


def _pythonic_calls(body: str) -> list[PartialCall] | None:
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        try:
            text = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):  # sets, bytes, complex: no JSON for them
            return None
        calls.append(PartialCall(node.func.id, text, True))
    return calls


class RequiredArrayParser(ToolParser):
    """What `tool_choice="required"` constrains the model to write (as vLLM): a JSON array of
    `{"name": ..., "parameters": {...}}` objects. Not a `--tool-call-parser` choice."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("" if not final else text)
        if text[i] != "[":
            return Parsed(text if final else "")
        i += 1
        calls: list[PartialCall] = []
        closed = False
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                break
            if text[i] == "]" and not calls:
                closed = True
                break
            call = scan_call(text, i)
            if call is None:
                return Parsed(text if final else "", [] if final else calls)
            calls.append(call)
            if not call.complete:
                break
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == ",":
                i += 1
            elif i < len(text) and text[i] == "]":
                closed = True
                break
            elif i < len(text):
                return Parsed(text if final else "", [] if final else calls)
        if final and not (closed and calls):
            return Parsed(text)
        return Parsed("", calls)


class NamedParser(ToolParser):
    """A named `tool_choice`: the whole output is the arguments of that one function."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [PartialCall(self.function, text if final else text.rstrip(), final)])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser)}


def get_parser(name: str) -> ToolParser:
    return PARSERS[name]()

"""A request's `tools` and `tool_choice` → a `ToolPlan`, with vLLM's rules and error messages.

- `tool_choice` defaults to "auto" when tools are sent, "none" otherwise.
- "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser NAME
  (else 400, as vLLM); the parser reads calls out of free text.
- "required" and a named function work without those flags: decoding is constrained to a JSON
  schema (required: an array of {name, parameters} over the tools, as vLLM; named: that
  function's parameters), so even a small model writes arguments that validate.
- "none": tools are still rendered into the prompt (vLLM's default), the output is plain content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.engine.server.errors import APIError, bad_request
from kvgate.engine.server.tools.parsers import (
    PARSERS,
    NamedParser,
    RequiredArrayParser,
    ToolParser,
    get_parser,
)

MAX_TOOLS = 128  # OpenAI's limit

AUTO_FLAGS_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: _FunctionName


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def check(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {self.tool_call_parser!r}; choose one of {', '.join(sorted(PARSERS))}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")


@dataclass
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[ChatTool]
    parallel: bool
    function: str | None = None  # named mode

    def parser(self, options: ToolOptions) -> ToolParser | None:
        """A fresh parser for one choice (None: the output is plain content)."""
        if self.mode == "required":
            return RequiredArrayParser()
        if self.mode == "named":
            assert self.function is not None
            return NamedParser(self.function)
        if self.mode == "auto" and options.tool_call_parser:
            return get_parser(options.tool_call_parser)
        return None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema decoding is constrained to (required / named), as vLLM builds it."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.function)
            return _parameters(tool)
        if self.mode != "required":
            return None
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": _parameters(t),
                        },
                        "required": ["name", "parameters"],
                    }
                    for t in self.tools
                ],
            },
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    options: ToolOptions,
) -> ToolPlan:
    """Validate the request's tool fields (400 naming the field) and say how to serve them."""
    parsed: list[ChatTool] = []
    if tools is not None:
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"At most {MAX_TOOLS} tools are allowed.", "tools")
        for i, raw in enumerate(tools):
            try:
                parsed.append(ChatTool.model_validate(raw))
            except ValidationError as exc:
                err = exc.errors(include_url=False, include_input=False)[0]
                where = ".".join(str(p) for p in err.get("loc", ()))
                raise bad_request(
                    f"Invalid tool at tools[{i}] ({where}): {err.get('msg')}.", "tools"
                ) from None
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if parsed else "none"
    if tool_choice == "none":
        return ToolPlan("none", parsed, parallel)
    if not parsed:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise bad_request(AUTO_FLAGS_ERROR, "tool_choice")
        return ToolPlan("auto", parsed, parallel)
    if tool_choice == "required":
        return ToolPlan("required", parsed, parallel)
    if isinstance(tool_choice, dict):
        try:
            named = NamedToolChoice.model_validate(tool_choice)
        except ValidationError:
            named = None
        if named is not None:
            if not any(t.function.name == named.function.name for t in parsed):
                raise bad_request(
                    f"Tool '{named.function.name}' has not been passed in `tools`.", "tool_choice"
                )
            return ToolPlan("named", parsed, parallel, named.function.name)
    raise APIError(
        400,
        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        param="tool_choice",
        code="invalid_value",
    )

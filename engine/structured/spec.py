"""What a request's output must match: one immutable, hashable `StructuredOutputSpec`.

The spec is the engine-internal form of every API surface for structured outputs
(`response_format`, vLLM's `guided_*` fields, `structured_outputs`, tool calling's
required/named `tool_choice`). It carries the constraint as canonical text, so equal
constraints are equal specs and share one compiled grammar (see `compiler.py`).

Kinds follow vLLM's `StructuredOutputsParams` fields:
- `json`: a JSON schema (the text of a JSON object, or `true`);
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
- `regex`: the whole output matches this regular expression;
- `choice`: the output is exactly one of these strings (a JSON list of strings);
- `grammar`: a context-free grammar, GBNF/EBNF (`root ::= ...`) or Lark (`start: ...`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# Generous for real use (OpenAI caps a strict schema at 100 properties / 5 levels; tools
# schemas of agent frameworks run to tens of kB), small enough that no request can make the
# compiler chew megabytes. Larger specs are a 400 before any compile.
MAX_SPEC_CHARS = 64 * 1024


class StructuredOutputError(ValueError):
    """The constraint cannot be used (bad JSON schema, regex or grammar, too large, too slow
    to compile). The message names the problem and is fit to show the user (a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: StructuredKind
    value: str  # canonical text of the constraint ("" for json_object)

    def __post_init__(self) -> None:
        if len(self.value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(
                f"The {self.kind} constraint is {len(self.value)} characters; at most "
                f"{MAX_SPEC_CHARS} are allowed."
            )

    # -- constructors (the only way callers should build one) --------------------------------
    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> StructuredOutputSpec:
        """Output is JSON valid against `schema` (a dict, its JSON text, or `true`)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"The JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise StructuredOutputError("A JSON schema must be a JSON object (or true).")
        # Key order is kept: it is the order properties are generated in.
        return cls("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        """Output is any JSON object."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError("The regex must be a non-empty string.")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutputSpec:
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings.")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputSpec:
        """A GBNF/EBNF grammar (`root ::= ...`) or a Lark grammar (`start: ...`)."""
        if not isinstance(text, str) or not text.strip():
            raise StructuredOutputError("The grammar must be a non-empty string.")
        return cls("grammar", text)

    # -- accessors -------------------------------------------------------------------------
    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        options: list[str] = json.loads(self.value)
        return options

    def describe(self) -> str:
        """Short, log-safe description (never the whole constraint)."""
        return f"{self.kind}[{len(self.value)} chars]"

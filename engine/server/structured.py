"""The API surfaces of structured outputs, read into one `StructuredOutputSpec`.

Accepted, as vLLM accepts them:
- OpenAI's `response_format`: `{"type": "json_object"}` and `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}` (`text`: no constraint);
- vLLM's newer `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
  `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  fields;
- tool calling's `required` / named `tool_choice` (see `tools.request.ToolPlan.json_schema`).

A request may name one constraint; two are a 400, as in vLLM. Output JSON is compact (no free
whitespace), so vLLM's whitespace options are refused rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvgate.engine.server.errors import bad_request
from kvgate.engine.structured import StructuredOutputError, StructuredOutputSpec


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute; OpenAI's field name is kept on the wire.
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="ignore")

    json_: str | dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    # Accepted and moot here: output JSON never has free whitespace, and there is no fallback
    # backend to disable.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False


class StructuredFields(BaseModel):
    """The request fields that ask for structured outputs (both generation endpoints)."""

    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # vLLM picks a backend; here there is one

    def structured_spec(self) -> StructuredOutputSpec | None:
        """The one constraint this request asks for (None: none). 400 when malformed."""
        found = self._constraints()
        if len(found) > 1:
            raise bad_request(
                "Only one kind of structured output may be requested; got "
                + ", ".join(f"'{param}'" for param, _ in found)
                + ".",
                found[1][0],
            )
        if not found:
            return None
        param, build = found[0]
        try:
            return build()
        except StructuredOutputError as exc:
            raise bad_request(str(exc), exc.param or param) from None

    def _constraints(self) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        if self.guided_whitespace_pattern is not None:
            raise bad_request(
                "guided_whitespace_pattern is not supported: JSON output is compact.",
                "guided_whitespace_pattern",
            )
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "structural_tag":
                raise bad_request("response_format 'structural_tag' is not supported.", "response_format")
            if rf.type == "json_object":
                found.append(("response_format", StructuredOutputSpec.json_object))
            else:
                fmt = rf.json_schema
                if fmt is None or fmt.json_schema is None:
                    raise bad_request(
                        "response_format of type 'json_schema' needs json_schema.schema.",
                        "response_format.json_schema",
                    )
                schema = fmt.json_schema
                found.append(("response_format", lambda: StructuredOutputSpec.json_schema(schema)))
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise bad_request("structural_tag is not supported.", "structured_outputs.structural_tag")
            if so.whitespace_pattern is not None:
                raise bad_request(
                    "whitespace_pattern is not supported: JSON output is compact.",
                    "structured_outputs.whitespace_pattern",
                )
            found += _kinds("structured_outputs.", so.json_, so.regex, so.choice, so.grammar)
            if so.json_object:
                found.append(("structured_outputs.json_object", StructuredOutputSpec.json_object))
        found += _kinds(
            "guided_", self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )
        return found


def _kinds(
    prefix: str, json_: Any, regex: Any, choice: Any, grammar: Any
) -> list[tuple[str, Callable[[], StructuredOutputSpec]]]:
    """The json/regex/choice/grammar constraints a request names, under vLLM's field names
    (`structured_outputs.json`, `guided_json`, ...), each with the builder of its spec."""
    builders: tuple[tuple[str, Any, Callable[[Any], StructuredOutputSpec]], ...] = (
        ("json", json_, StructuredOutputSpec.json_schema),
        ("regex", regex, StructuredOutputSpec.regex),
        ("choice", choice, StructuredOutputSpec.choice),
        ("grammar", grammar, StructuredOutputSpec.grammar),
    )
    return [
        (f"{prefix}{name}", partial(build, value)) for name, value, build in builders if value is not None
    ]

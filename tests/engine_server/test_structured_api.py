"""Structured outputs through a real simulated `kvgate engine serve` with the openai client:
every request surface vLLM accepts, streamed and not, and a clear 400 for each bad constraint.
The simulated runner samples only what the grammar allows, so its outputs must validate."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

MODEL = "sim-model"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["city", "population", "capital", "districts"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


def _streamed_text(stream: Any) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            c = chunk.choices[0]
            text += (c.delta.content if hasattr(c, "delta") else c.text) or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_returns_valid_json(client: OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kw: dict[str, Any] = dict(model=MODEL, messages=ASK, response_format=fmt, max_tokens=200, seed=seed)
        if stream:
            text, finish = _streamed_text(client.chat.completions.create(stream=True, **kw))
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_n_choices(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=200, n=3, seed=5
    )
    assert len(r.choices) == 3
    for c in r.choices:
        assert isinstance(json.loads(c.message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (
            {"guided_regex": r"[A-Z][a-z]{2,6}-[0-9]{2}"},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{2}", t),
        ),
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_grammar": 'root ::= "ok" | "no" [0-9]'}, lambda t: re.fullmatch(r"ok|no[0-9]", t)),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"structured_outputs": {"choice": ["a1", "b2"]}}, lambda t: t in ("a1", "b2")),
        ({"structured_outputs": {"regex": "x+y"}}, lambda t: re.fullmatch("x+y", t)),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA),
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_vllm_surface(client: OpenAI, extra: dict, check: Any, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="Answer:", max_tokens=200, extra_body=extra)
    if stream:
        text, finish = _streamed_text(client.completions.create(stream=True, **kw))
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert finish == "stop", text
    assert check(text) is not False, text


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"guided_regex": "(("}, None, "Invalid regex"),
        ({"guided_json": {"type": "nope"}}, None, "Invalid JSON schema"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"guided_grammar": "root ::= undefined"}, None, "Invalid grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one kind"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", None),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
        ({"guided_regex": "a" * 70_000}, "guided_regex", "at most"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    client: OpenAI, extra: dict, param: str | None, match: str | None
) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    assert err.value.type == "invalid_request_error"
    if param is not None:
        assert err.value.param == param


def test_tools_required_cannot_be_combined_with_a_response_format(client: OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=tools,
            tool_choice="required",
            response_format={"type": "json_object"},
        )


def test_a_hostile_schema_answers_quickly_and_the_engine_keeps_serving(client: OpenAI) -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_json": deep})
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    assert r.choices[0].text

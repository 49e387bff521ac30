"""Structured outputs and tool calling on the real default model (SmolLM2-135M-Instruct) through
the gateway (Envoy + EPP) of `kvgate up`, with the openai client and langchain-openai.

`response_format` JSON schemas, `required` and a named `tool_choice` are enforced by grammar,
so even this small model returns JSON that validates against the schema and calls whose
arguments validate against the function's parameters, streamed and not."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import jsonschema
import pytest
from openai import OpenAI

from kvgate.testing.local_up import UpProcess, start_up, stop_up

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string"},
                "offset": {"type": "integer", "minimum": -12, "maximum": 14},
            },
            "required": ["zone", "offset"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "express": {"type": "boolean"},
            "status": {"type": "string", "enum": ["new", "paid", "shipped"]},
        },
        "required": ["items", "express", "status"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "temperature_c": {"type": "number"},
            "conditions": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
        },
        "required": ["city", "temperature_c", "conditions"],
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(
        tmp_path_factory.mktemp("tools"),
        "--engines", "1", "--quiet", "--ready-timeout", "240",
        "--engine-arg=--enable-auto-tool-choice", "--engine-arg=--tool-call-parser", "--engine-arg=hermes",
    )  # fmt: skip
    try:
        up.wait_for_line(r"^curl ", timeout=260)
        yield up
    finally:
        stop_up(up)


@pytest.fixture(scope="module")
def client(stack: UpProcess) -> OpenAI:
    return OpenAI(base_url=f"{stack.stack['gateway_url']}/v1", api_key="none", max_retries=0, timeout=180)


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: OpenAI, parallel: bool) -> None:
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=0, parallel_tool_calls=parallel,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        _valid(call.function.name, call.function.arguments)


def test_named_choice_returns_that_function_with_valid_arguments(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _valid("get_time", call.function.arguments)


def _streamed_calls(client: OpenAI, **kw) -> tuple[list[dict], str | None]:
    calls: list[dict] = []
    finish = None
    for chunk in client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, stream=True, **kw
    ):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.index == len(calls):  # a call's first delta: its id, type and name
                assert tc.id and tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                calls.append({"name": tc.function.name, "arguments": "", "fragments": 0})
            else:
                assert tc.id is None and not (tc.function and tc.function.name)
            if tc.function and tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["fragments"] += 1
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish


@pytest.mark.parametrize(
    ("choice", "finish"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_streamed_calls_arrive_in_fragments_and_validate(client: OpenAI, choice, finish: str) -> None:
    calls, finish_reason = _streamed_calls(client, tool_choice=choice, max_tokens=120, temperature=0)
    assert calls and finish_reason == finish
    for call in calls:
        _valid(call["name"], call["arguments"])
        assert call["fragments"] > 1  # streamed as generated, not in one piece at the end


def test_tool_history_and_auto_through_the_gateway(client: OpenAI) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 degrees and sunny"}]  # fmt: skip
    r = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


@pytest.mark.skipif(
    importlib.util.find_spec("langchain_openai") is None, reason="langchain-openai not installed"
)
def test_langchain_bind_tools(stack: UpProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="default", base_url=f"{stack.stack['gateway_url']}/v1", api_key="none", temperature=0,
        max_tokens=120, max_retries=0,
    )  # fmt: skip
    for kw in ({"tool_choice": "required"}, {"tool_choice": "get_time"}):
        msg = llm.bind_tools(TOOLS, **kw).invoke("What time is it in Tokyo?")
        assert msg.tool_calls, msg
        for call in msg.tool_calls:
            jsonschema.validate(call["args"], PARAMS[call["name"]])
    streamed = None
    for part in llm.bind_tools(TOOLS, tool_choice="get_weather").stream("Weather in Rome?"):
        streamed = part if streamed is None else streamed + part
    assert streamed is not None and streamed.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(streamed.tool_calls[0]["args"], PARAMS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_validates(client: OpenAI, name: str, stream: bool) -> None:
    schema = SCHEMAS[name]
    kw = dict(
        model="default", max_tokens=150, temperature=0,
        messages=[{"role": "user", "content": f"Invent a {name} and give it as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )  # fmt: skip
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.skipif(
    importlib.util.find_spec("langchain_openai") is None, reason="langchain-openai not installed"
)
def test_langchain_with_structured_output(stack: UpProcess) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=130)

    llm = ChatOpenAI(
        model="default", base_url=f"{stack.stack['gateway_url']}/v1", api_key="none", temperature=0,
        max_tokens=100, max_retries=0,
    )  # fmt: skip
    for method in ("json_schema", "function_calling", "json_mode"):
        prompt = "Invent a person. Answer in JSON with keys name and age."
        person = llm.with_structured_output(Person, method=method).invoke(prompt)
        assert isinstance(person, Person), (method, person)

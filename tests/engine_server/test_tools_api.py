"""`tools` / `tool_choice` on a real simulated `kvgate engine serve`, through the openai client:
vLLM's rules for what is accepted. The simulator writes random text, but only what a grammar
allows, so required/named calls validate here too; e2e/test_structured_outputs.py checks them on the
real model."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import OpenAI

from kvgate.testing.engine_server import launch, spawn

from .conftest import API_KEY, SIM_ARGS

MODEL = "sim-model"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]


@pytest.fixture(scope="module")
def auto_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    eng = launch(
        tmp_path_factory.mktemp("tools-engine"),
        *SIM_ARGS,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield OpenAI(base_url=f"{eng.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    eng.stop(signal.SIGKILL)


def _chat(client: OpenAI, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, **kw)


@pytest.mark.parametrize("kw", [{}, {"tool_choice": "auto"}])
def test_auto_needs_both_flags_as_in_vllm(client: OpenAI, kw: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, tools=TOOLS, **kw)  # tools without tool_choice mean "auto"
    assert "--enable-auto-tool-choice and --tool-call-parser" in err.value.message
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"description": "no name"}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_tool_fields_are_400(client: OpenAI, kw: dict, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        _chat(client, **kw)


def test_tool_history_is_accepted_and_none_answers_in_text(client: OpenAI) -> None:
    r = _chat(client, messages=HISTORY, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        bad = [
            HISTORY[0],
            {**HISTORY[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]},
        ]
        _chat(client, messages=bad)


def test_required_and_named_are_served_without_the_auto_flags(client: OpenAI) -> None:
    """Without the auto flags, and valid: decoding is constrained to the calls' schema (the
    simulator samples only what the grammar allows)."""
    params = TOOLS[0]["function"]["parameters"]
    for choice, finish in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ):
        for seed in range(3):
            r = _chat(client, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=seed)
            (call,) = r.choices[0].message.tool_calls or [None]
            assert call is not None and call.function.name == "get_weather", r
            jsonschema.validate(json.loads(call.function.arguments), params)
            assert r.choices[0].finish_reason == finish


def test_auto_with_the_flags_streams_and_answers(auto_client: OpenAI) -> None:
    r = _chat(auto_client, messages=HISTORY, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(_chat(auto_client, tools=TOOLS, tool_choice="auto", stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
        (("--tool-call-parser", "nonesuch"), "invalid choice"),
    ],
)
def test_bad_tool_flags_stop_start_up(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    eng = spawn(tmp_path, "--simulate", *flags)
    assert eng.proc.wait(timeout=60) != 0
    assert message in eng.log

"""Tool-call parsers and streamed tool-call deltas (pure functions, no server)."""

from __future__ import annotations

import json

import pytest

from kvgate.engine.server.tools.parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    PythonicParser,
    RequiredArrayParser,
    ToolParser,
)
from kvgate.engine.server.tools.stream import ToolStreamer


def calls(parser: ToolParser, text: str) -> tuple[str, list[tuple[str | None, dict]]]:
    p = parser.parse(text, final=True)
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.calls]


def test_registry_names_vllm_parsers() -> None:
    assert {"hermes", "llama3_json", "pythonic"} <= set(PARSERS)


def test_hermes_one_and_many_calls_with_content_before() -> None:
    text = (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"city": "Rome", "days": 2}, "name": "get_weather"}</tool_call>'
    )
    content, got = calls(HermesParser(), text)
    assert content == "Let me check."
    assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]


def test_hermes_unterminated_last_block_and_string_arguments() -> None:
    content, got = calls(HermesParser(), '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert content == "" and got == [("f", {"x": 1})]
    assert calls(HermesParser(), '<tool_call>{"name": "g"}</tool_call>')[1] == [("g", {})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f"} trailing</tool_call>',
        "<tool_call>",
        '<tool_call>{"name": "f", "argu',
    ],
)
def test_hermes_malformed_output_is_content(text: str) -> None:
    assert HermesParser().parse(text, final=True).content == text
    assert HermesParser().parse(text, final=True).calls == []


def test_llama3_json_calls_and_plain_answers() -> None:
    got = calls(
        Llama3JsonParser(),
        '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "arguments": {}}',
    )
    assert got == ("", [("a", {"q": "x"}), ("b", {})])
    assert calls(Llama3JsonParser(), ' {"name": "a", "parameters": {"q": 1}}') == ("", [("a", {"q": 1})])
    for text in (
        "The answer is 4.",
        '{"answer": 4}',
        '{"name": "a", "parameters": {',
        '{"name": "a"} and more',
        "",
    ):
        assert Llama3JsonParser().parse(text, final=True).content == text
        assert Llama3JsonParser().parse(text, final=True).calls == []


def test_pythonic_literal_calls_only() -> None:
    got = calls(PythonicParser(), '[get_weather(city="Paris", days=2), now()]')
    assert got == ("", [("get_weather", {"city": "Paris", "days": 2}), ("now", {})])
    assert calls(PythonicParser(), "<|python_start|>[f(x=[1, 2])]<|python_end|>")[1] == [("f", {"x": [1, 2]})]
    for text in (
        "[f(__import__('os'))]",
        "[f(x=g())]",
        "[os.system(x='ls')]",
        "[f(x=",
        "Hello",
        "[f(x={1})]",
    ):
        parsed = PythonicParser().parse(text, final=True)
        assert parsed.calls == [] and parsed.content == text


def test_required_array_and_named() -> None:
    got = calls(
        RequiredArrayParser(), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    )
    assert got == ("", [("f", {"a": 1}), ("g", {})])
    assert RequiredArrayParser().parse("[]", final=True).calls == []
    assert RequiredArrayParser().parse('[{"name": "f", "parameters": {"a"', final=True).calls == []
    assert calls(NamedParser("f"), '{"a": 1}') == ("", [("f", {"a": 1})])


def stream(parser: ToolParser, text: str, step: int = 1) -> list[dict]:
    streamer = ToolStreamer(parser)
    deltas = [streamer.delta(text[:i], final=False) for i in range(step, len(text), step)]
    deltas.append(streamer.delta(text, final=True))
    return [d for d in deltas if d]


def assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    content = "".join(d.get("content", "") for d in deltas)
    out: list[dict] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(out):
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                out.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            else:
                assert "id" not in tc and "name" not in tc["function"]
            out[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return content, out


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_stream_is_the_non_streamed_answer_in_pieces(step: int) -> None:
    text = (
        'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par}is", "n": [1, {"d": 2}]}}</tool_call>'
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    )
    deltas = stream(HermesParser(), text, step)
    content, got = assemble(deltas)
    assert content == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls(HermesParser(), text)[1]
    # arguments arrive in several fragments, not all at the end
    assert step > 1 or sum(1 for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0) > 5
    # no markup leaks into content
    assert "<" not in content


def test_stream_of_malformed_markup_ends_as_content() -> None:
    text = "Hi <tool_call>{oops}</tool_call>"
    content, got = assemble(stream(HermesParser(), text))
    assert content == text and got == []


def test_stream_of_plain_text_holds_back_only_a_possible_tag() -> None:
    streamer = ToolStreamer(HermesParser())
    assert streamer.delta("Hello <tool", final=False) == {"content": "Hello "}
    assert streamer.delta("Hello <tools are", final=False) == {"content": "<tools are"}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            Llama3JsonParser(),
            '{"name": "a", "parameters": {"q": "x y"}}; {"name": "b", "parameters": {"z": 1}}',
        ),
        (
            RequiredArrayParser(),
            '[{"name": "f", "parameters": {"a": [1, 2]}}, {"name": "g", "parameters": {}}]',
        ),
        (NamedParser("f"), '{"a": [1, 2], "b": "c"}'),
        (PythonicParser(), '[f(a=1), g(b="x")]'),
    ],
)
def test_other_parsers_stream_the_same_calls(parser: ToolParser, text: str) -> None:
    content, got = assemble(stream(parser, text))
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls(parser, text)[1]

"""Batch input validation: each bad line is named by its 1-based number."""

from __future__ import annotations

import json

import pytest

from kvgate.batch.jsonl import InputError, parse_input


def line(custom_id: str = "a", url: str = "/v1/chat/completions", **over: object) -> str:
    doc: dict[str, object] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "m", "messages": []},
    }
    doc.update(over)
    return json.dumps(doc)


def data(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_good_file_parses_every_line_in_order_skipping_blank_lines() -> None:
    out = parse_input(data(line("a"), "", line("b", url="/v1/completions")))
    assert [(x.index, x.custom_id, x.url) for x in out] == [
        (0, "a", "/v1/chat/completions"),
        (1, "b", "/v1/completions"),
    ]


@pytest.mark.parametrize(
    ("bad", "words", "param"),
    [
        ("{not json", "invalid JSON", None),
        ("[1, 2]", "JSON object", None),
        (line("a"), "duplicate custom_id 'a' (first on line 1)", "custom_id"),
        (line("b", url="/v1/embeddings"), "url must be one of", "url"),
        (line("b", method="GET"), 'method must be "POST"', "method"),
        (line("b", body="text"), "body must be a JSON object", "body"),
        (line(""), "custom_id must be a non-empty string", "custom_id"),
        (line("b", extra=1), "unknown field 'extra'", None),
        (line("b", body={"stream": True}), "streaming", "body.stream"),
    ],
)
def test_a_bad_second_line_is_reported_with_its_number(bad: str, words: str, param: str | None) -> None:
    with pytest.raises(InputError) as caught:
        parse_input(data(line("a"), bad, line("c")))
    assert caught.value.line == 2
    assert words in caught.value.message
    assert caught.value.param == param


def test_bounds_empty_and_non_utf8() -> None:
    with pytest.raises(InputError, match="more than 2 requests") as caught:
        parse_input(data(line("a"), line("b"), line("c")), max_lines=2)
    assert caught.value.line == 3
    with pytest.raises(InputError, match="no requests"):
        parse_input(b"\n\n")
    with pytest.raises(InputError, match="UTF-8") as caught:
        parse_input(data(line("a")) + b"\xff\xfe")
    assert caught.value.line == 2

"""Validation of an uploaded batch input file (JSONL), line by line, as OpenAI checks it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class InputLine:
    index: int  # 0-based position in the file
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class InputError(ValueError):
    """One bad line: ``line`` is 1-based, as an editor shows it."""

    def __init__(self, line: int, message: str, param: str | None = None) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message
        self.param = param


def parse_input(data: bytes, *, max_lines: int = MAX_LINES) -> list[InputLine]:
    """Every line of a batch input file, or InputError for the first bad one.

    Blank lines are skipped (a trailing newline is common); each other line must be a JSON
    object ``{custom_id, method: "POST", url, body}`` with ``url`` one of ENDPOINTS and
    ``custom_id`` unique in the file.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise InputError(line, "the file is not valid UTF-8") from None
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            raise InputError(number, f"the file has more than {max_lines} requests")
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(number, f"invalid JSON: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise InputError(number, "each line must be a JSON object")
        lines.append(_line(doc, number, len(lines), seen))
    if not lines:
        raise InputError(1, "the file has no requests")
    return lines


def _line(doc: dict[str, Any], number: int, index: int, seen: dict[str, int]) -> InputLine:
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(number, "custom_id must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InputError(number, f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id")
    if custom_id in seen:
        raise InputError(
            number, f"duplicate custom_id {custom_id!r} (first on line {seen[custom_id]})", "custom_id"
        )
    method = doc.get("method")
    if method != "POST":
        raise InputError(number, 'method must be "POST"', "method")
    url = doc.get("url")
    if url not in ENDPOINTS:
        raise InputError(number, f"url must be one of {', '.join(ENDPOINTS)}", "url")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise InputError(number, "body must be a JSON object", "body")
    if body.get("stream"):
        raise InputError(number, "streaming is not supported in a batch", "body.stream")
    extra = set(doc) - {"custom_id", "method", "url", "body"}
    if extra:
        raise InputError(number, f"unknown field {sorted(extra)[0]!r}")
    seen[custom_id] = number
    return InputLine(index, custom_id, method, url, body)

"""Reading `{"name": ..., "arguments": {...}}` call objects out of text that may still be growing.

Streaming sends a call's arguments as they are generated, so the scanner must say, for a prefix
of the final text, which part of the arguments is already certain. It walks the object's
top-level members with `json.JSONDecoder.raw_decode` (C speed): a member whose value decodes is
final; the first one that does not runs to the end of the text (incomplete, or malformed — the
two look alike until the text ends). The arguments' raw text is kept as generated, so what was
streamed is always a prefix of what the finished call carries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


@dataclass
class PartialCall:
    """One call as far as the text shows it."""

    name: str | None  # set once the name's string is complete
    arguments: str  # the arguments' JSON text that is certain so far ("" until known)
    complete: bool  # the call's object is closed: name and arguments are final
    end: int = 0  # where the object ends in the scanned text (when complete)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_call(
    text: str, start: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")
) -> PartialCall | None:
    """The call object starting at text[start] (after whitespace); None when the text there is
    not (the start of) a JSON object, or the object is closed but is no valid call."""
    i = skip_ws(text, start)
    if i >= len(text):
        return PartialCall(None, "", False)
    if text[i] != "{":
        return None
    i += 1
    name: str | None = None
    args = ""
    args_final = False
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return PartialCall(name, args, False)
        if text[i] == "}":
            if name is None:
                return None
            if not args_final:
                args = "{}"  # a function without parameters may omit them
            return PartialCall(name, args, True, i + 1)
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return PartialCall(name, args, False)
        if not isinstance(key, str):
            return None
        i = skip_ws(text, i)
        if i >= len(text):
            return PartialCall(name, args, False)
        if text[i] != ":":
            return None
        i = skip_ws(text, i + 1)
        value_start = i
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            # Incomplete (or malformed): everything to the end of the text is this value.
            if key in arg_keys and text[value_start : value_start + 1] == "{":
                args = text[value_start:].rstrip(_WS)
            return PartialCall(name, args, False)
        if key == "name":
            if not isinstance(value, str):
                return None
            name = value
        elif key in arg_keys and not args_final:
            if isinstance(value, dict):
                args = text[value_start:i]
            elif isinstance(value, str):  # some models send the arguments JSON-encoded
                args = value
            else:
                return None
            args_final = True
        i = skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] != "}":
            return None


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False

"""The JSON schema the structured-output benchmarks compile and constrain with: a typical API
record (strings with limits and a pattern, an enum, numbers, an array, a nested object), and a
valid instance of it. One copy for `bench/structured_backends.py` and `bench/structured_outputs.py`."""

from __future__ import annotations

import json
from typing import Any

TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "active", "tags", "address", "score"],
    "additionalProperties": False,
}

TYPICAL_INSTANCE: dict[str, Any] = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "role": "admin",
    "active": True,
    "tags": ["math", "engines"],
    "address": {"street": "12 St James Square", "city": "London", "zip": "10001"},
    "score": 99.5,
}


def typical_schema_variant(i: int) -> dict[str, Any]:
    """The typical schema made distinct (a cold compile each time, no compiler cache hit)."""
    schema = json.loads(json.dumps(TYPICAL_SCHEMA))
    schema["properties"]["name"]["maxLength"] = 40 + i
    return schema

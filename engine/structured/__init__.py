"""Structured outputs: constrain decoding so the output matches a JSON schema, regex, choice
list or grammar (guided decoding with per-step token bitmasks).

- `spec.py`: `StructuredOutputSpec`, what a request asks for (carried on `SamplingParams`).

Only `spec` is imported here: it has no heavy dependencies, so `SamplingParams` can carry a
spec without importing the grammar library.
"""

from kvgate.engine.structured.spec import (
    MAX_SPEC_CHARS,
    StructuredKind,
    StructuredOutputError,
    StructuredOutputSpec,
)

__all__ = ["MAX_SPEC_CHARS", "StructuredKind", "StructuredOutputError", "StructuredOutputSpec"]

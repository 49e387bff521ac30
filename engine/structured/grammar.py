"""Compiled grammars and per-request matchers, on llguidance.

Why llguidance (measured on this CPU with the default model's 49,152-token vocabulary, see
`bench/structured_backends.py`): it compiles lazily with hard resource limits, so no request can
make the engine spend seconds compiling (xgrammar took 4.1 s on a 2,000-property schema and
0.7 s on a 200-deep one; llguidance 0.17 s and a clean error), it reads GBNF and Lark and embeds
JSON schemas in a grammar (tool-call formats), and its per-step mask (0.2 ms for 8 rows) is
small next to a decode step. xgrammar's masks are faster (0.04 ms), which matters less than
bounded compiles when the schemas come from clients.

`GrammarCompiler.compile` turns a spec into a validated template matcher, kept in an LRU cache;
each request gets a `deep_copy` of it (a copy costs microseconds, a compile up to ~100 ms).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch as llg_torch
import torch

from kvgate.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON with the separators json.dumps uses: models write it naturally, and without
# free whitespace a small model cannot wander into endless newlines inside an object.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

CACHE_SIZE = 256


def _limits() -> llguidance.LLParserLimits:
    """llguidance's defaults, tightened where a client-supplied grammar could make one compile
    or one step cost far more than a decode step (speeds from llguidance's documentation)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,  # regex analysis at compile: ~20 ms
        step_lexer_fuel=200_000,  # per step: ~15 ms at worst
        step_max_items=50_000,
        max_lexer_states=100_000,  # ~1-2 kB each
        max_grammar_size=200_000,
    )


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar for a spec. Raises StructuredOutputError for bad input."""
    try:
        if spec.kind == "json":
            schema = _closed_objects(json.loads(spec.value))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", spec.value)  # GBNF or Lark
    except ValueError as exc:
        raise StructuredOutputError(f"Invalid {_NAMES[spec.kind]}: {_one_line(exc)}") from None


_VALUES = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every schema that lists `properties`
    and does not say (an object with no `properties` stays open: any object).

    vLLM's default backend (xgrammar, strict mode) reads schemas this way, and vLLM closes
    objects the same way for llguidance: without it a model may append properties of its own
    after the required ones (a small model rambles on in an invented "description" until
    max_tokens, and the JSON never closes). A schema that wants extra properties says so.
    """
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else _closed_objects(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def _one_line(exc: BaseException | str) -> str:
    """The library's message on one line, bounded (it may quote the whole grammar)."""
    text = " ".join(str(exc).split())
    return (text or "unknown error")[:300]


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` (speculative tokens) the grammar allows in turn from here, each
        checked against the same mask sampling uses; stops after a token that completes the
        grammar (plain decoding would stop there). Leaves the matcher where it was."""
        m = self._m
        n = 0
        for d in drafts:
            if m.is_stopped() or m.is_error():
                break
            mask = m.compute_bitmask()
            if not (0 <= d < 8 * len(mask) and (mask[d >> 3] >> (d & 7)) & 1):
                break
            if not m.consume_token(d) or m.is_error():
                m.rollback(1)
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    @property
    def finished(self) -> bool:
        """The output is complete: nothing but EOS may follow."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe (the server compiles off the event
    loop while the engine thread creates matchers)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        backend = getattr(tokenizer, "backend", tokenizer)  # kvgate's Tokenizer wraps `tokenizers`
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._cache: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec) -> None:
        """Compile and cache `spec`. Raises StructuredOutputError (fit for a 400)."""
        self._template(spec)

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        return GrammarMatcher(self._template(spec).deep_copy())

    def _template(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
                return found
        text = grammar_text(spec)
        # Building the matcher is the compile: it drops the GIL, so other requests go on.
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=_limits())
        if matcher.is_error():
            raise StructuredOutputError(f"Invalid {_NAMES[spec.kind]}: {_one_line(matcher.get_error())}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """Allowed next tokens of each matcher: int32 [rows, ceil(vocab/32)], bit (t % 32) of
        word t // 32 set when token t is allowed. Rows are computed in parallel.

        With `drafts` (speculative decoding, one list per matcher, each allowed in turn: see
        `GrammarMatcher.valid_drafts`), matcher j takes 1 + len(drafts[j]) consecutive rows:
        its mask now, then after each of its drafts; the matchers are left where they were."""
        words = (self.vocab_size + 31) // 32
        if drafts is None:
            bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
            llg_torch.fill_next_token_bitmask_par(
                self._executor, [(m._m, i) for i, m in enumerate(matchers)], bitmask
            )
            return bitmask
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        row = 0
        for m, d in zip(matchers, drafts, strict=True):
            if d:
                drafted.append((m._m, row, list(d)))
            else:  # (llguidance's draft variant refuses an empty list)
                plain.append((m._m, row))
            row += 1 + len(d)
        bitmask = torch.full((row, words), -1, dtype=torch.int32)
        if plain:
            llg_torch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            llg_torch.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return bitmask

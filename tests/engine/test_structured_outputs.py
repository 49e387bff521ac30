"""Structured outputs in the engine: the grammar compiler, the sampler's bitmask, and whole
requests on the simulated runner (which samples only what the grammar allows) sharing batches
with unconstrained ones, through preemption."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.layers.sampler import Sampler, SampleRequest
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.structured import StructuredOutputError, StructuredOutputSpec
from kvgate.engine.structured.bitmask import allowed_token_ids, unpack_bitmask
from kvgate.engine.structured.grammar import GrammarCompiler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tok: Any) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok))


def _engine(tok: Any, num_kv_blocks: int = 256, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        simulate=True,
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        simulation=SimulationConfig(time_scale=0),
        **kw,
    )
    return LLMEngine(cfg, tokenizer=tok)


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")


# ---- the compiler -----------------------------------------------------------------------------


def test_a_valid_instance_is_allowed_token_by_token_and_completes_the_grammar(
    compiler: GrammarCompiler, tok: Any
) -> None:
    spec = StructuredOutputSpec.json_schema(PERSON)
    m = compiler.matcher(spec)
    text = json.dumps({"name": "Ada", "age": 36, "role": "admin", "tags": ["x"]})
    for t in tok.encode(text):
        assert not m.finished
        assert t in allowed_token_ids(compiler.fill_bitmask([m])[0], len(tok))
        assert m.accept(t)
    assert m.finished and m.error is None


def test_the_grammar_refuses_what_breaks_the_schema(compiler: GrammarCompiler, tok: Any) -> None:
    m = compiler.matcher(StructuredOutputSpec.json_schema(PERSON))
    for t in tok.encode('{"name": "Ada", "age": '):
        assert m.accept(t)
    allowed = set(allowed_token_ids(compiler.fill_bitmask([m])[0], len(tok)))
    assert tok.encode('"')[0] not in allowed  # age is an integer
    assert not m.accept(tok.encode('"')[0])


def _accepts(compiler: GrammarCompiler, tok: Any, spec: StructuredOutputSpec, text: str) -> bool:
    m = compiler.matcher(spec)
    return all(m.accept(t) for t in tok.encode(text)) and m.finished


def test_objects_with_properties_are_closed_unless_the_schema_opens_them(
    compiler: GrammarCompiler, tok: Any
) -> None:
    """As vLLM's default backend reads schemas: listed properties only, unless
    additionalProperties says otherwise; an object with no properties stays any object."""
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _accepts(compiler, tok, StructuredOutputSpec.json_schema(listed), '{"a": 1}')
    assert not _accepts(compiler, tok, StructuredOutputSpec.json_schema(listed), '{"a": 1, "b": 2}')
    opened = {**listed, "additionalProperties": True}
    assert _accepts(compiler, tok, StructuredOutputSpec.json_schema(opened), '{"a": 1, "b": 2}')
    anything = {"type": "object"}
    assert _accepts(compiler, tok, StructuredOutputSpec.json_schema(anything), '{"b": [2]}')
    # A const that looks like a schema is a value, not a schema: left as written.
    const = {"type": "object", "properties": {"k": {"const": {"type": "object", "properties": {}}}}}
    assert _accepts(
        compiler, tok, StructuredOutputSpec.json_schema(const), '{"k": {"type": "object", "properties": {}}}'
    )


def test_compiled_grammars_are_cached_and_matchers_are_independent(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputSpec.choice(["yes", "no"])
    compiler.compile(spec)
    assert compiler._template(spec) is compiler._template(StructuredOutputSpec.choice(["yes", "no"]))
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    assert a._m is not b._m


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (lambda: StructuredOutputSpec.regex("(("), "Invalid regex"),
        (lambda: StructuredOutputSpec.json_schema({"type": "nope"}), "Invalid JSON schema"),
        (lambda: StructuredOutputSpec.grammar("root ::= missing"), "Invalid grammar"),
        (lambda: StructuredOutputSpec.grammar("start: undefined_rule"), "Invalid grammar"),
        (lambda: StructuredOutputSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredOutputSpec.choice([]), "non-empty list"),
        (lambda: StructuredOutputSpec.regex("a" * 70_000), "at most"),
    ],
)
def test_bad_constraints_are_clear_errors(compiler: GrammarCompiler, spec: Any, match: str) -> None:
    with pytest.raises(StructuredOutputError, match=match):
        compiler.compile(spec())


def test_hostile_schemas_end_in_an_answer_not_a_hang(compiler: GrammarCompiler) -> None:
    """A 200-deep schema is refused (recursion limit); 2,000 patterned properties compile
    within the library's fuel limits (xgrammar took 4 s on it; see the module's docstring)."""
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(StructuredOutputError):
        compiler.compile(StructuredOutputSpec.json_schema(deep))
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]+$"} for i in range(2000)},
        "required": [f"p{i}" for i in range(2000)],
    }
    try:
        compiler.compile(StructuredOutputSpec.json_schema(wide))
    except StructuredOutputError:
        pass


# ---- the sampler --------------------------------------------------------------------------------


def test_unpack_matches_the_bit_layout() -> None:
    words = torch.tensor([[1 - 2**31, 0, 1 << 5]], dtype=torch.int32)  # bits 0 and 31 of word 0
    allowed = unpack_bitmask(words, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 69]


def test_the_mask_binds_constrained_rows_only_and_the_grammar_end_beats_min_tokens() -> None:
    vocab = 64
    sampler = Sampler(torch.device("cpu"), stop_token_ids_for_min_tokens=[7])
    logits = torch.zeros(3, vocab)
    logits[:, 3] = 10.0  # every row's favourite
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 9  # row 0 may only say 9
    mask[1, 0] = 1 << 7  # row 2 may only end (7), yet min_tokens masks 7
    greedy = SamplingParams(temperature=0)
    rows = [
        SampleRequest("a", greedy, bitmask_row=0),
        SampleRequest("b", greedy),
        SampleRequest("c", SamplingParams(temperature=0, min_tokens=5), bitmask_row=1),
    ]
    out = sampler(logits, rows, mask)
    assert [t.token_id for t in out] == [9, 3, 7]
    sampled = sampler(
        logits[:1], [SampleRequest("d", SamplingParams(temperature=1.0, seed=1), bitmask_row=0)], mask
    )
    assert sampled[0].token_id == 9  # random sampling draws from the allowed set too


# ---- whole requests on the simulated runner -------------------------------------------------


def test_constrained_requests_share_batches_and_leave_others_unchanged(tok: Any) -> None:
    prompt = tok.encode("Give me a person as JSON.")
    specs = {
        "json": StructuredOutputSpec.json_schema(PERSON),
        "object": StructuredOutputSpec.json_object(),
        "regex": StructuredOutputSpec.regex(r"[0-9]{3}-[a-z]{2,5}"),
        "choice": StructuredOutputSpec.choice(["alpha", "beta", "gamma"]),
        "gbnf": StructuredOutputSpec.grammar('root ::= "A" | "B" "C"'),
        "lark": StructuredOutputSpec.grammar('start: "x" NUM\nNUM: /[0-9]{2}/'),
    }
    alone = _engine(tok)
    alone.add_request("free", prompt, SamplingParams(max_tokens=40, seed=3))
    free_alone = _run(alone)["free"]

    engine = _engine(tok)
    engine.add_request("free", prompt, SamplingParams(max_tokens=40, seed=3))
    for name, spec in specs.items():
        engine.add_request(name, prompt, SamplingParams(max_tokens=80, structured_outputs=spec))
    out = _run(engine)
    assert out["free"].token_ids == free_alone.token_ids
    for name in specs:
        assert out[name].finish_reason == "stop", (name, out[name].text)
    jsonschema.validate(json.loads(out["json"].text), PERSON)
    assert isinstance(json.loads(out["object"].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", out["regex"].text)
    assert out["choice"].text in ("alpha", "beta", "gamma")
    assert out["gbnf"].text in ("A", "BC")
    assert re.fullmatch(r"x[0-9]{2}", out["lark"].text)
    assert engine.get_stats().num_running == 0


def test_grammars_survive_preemption_by_recompute(tok: Any) -> None:
    engine = _engine(tok, num_kv_blocks=12, max_num_seqs=8)
    prompt = tok.encode("x " * 40)
    spec = StructuredOutputSpec.json_schema(PERSON)
    for i in range(6):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=120, structured_outputs=spec, seed=i))
    out = _run(engine)
    assert len(out) == 6
    for o in out.values():
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert engine.get_stats().num_preemptions_total > 0, "the pool was meant to be too small for all six"


def test_a_bad_spec_is_refused_when_the_request_is_added(tok: Any) -> None:
    engine = _engine(tok)
    with pytest.raises(ValueError, match="Invalid regex"):
        engine.add_request(
            "r", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputSpec.regex("(("))
        )
    assert not engine.has_unfinished_requests()


def test_an_engine_without_a_tokenizer_says_so(tok: Any) -> None:
    from kvgate.engine.structured.manager import StructuredOutputManager

    with pytest.raises(StructuredOutputError, match="tokenizer"):
        StructuredOutputManager(None, 1000).compile(StructuredOutputSpec.json_object())

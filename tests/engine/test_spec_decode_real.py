"""Speculative decoding over the REAL default model on CPU: greedy output with n-gram drafts
is token for token the output without, on a grounded prompt (a passage to repeat: drafts are
accepted) and a free one, with stop strings and max_tokens; seeded sampling reproduces."""

from __future__ import annotations

import pytest

from kvgate.engine.llm import LLM
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode import SpeculativeConfig
from tests.engine.spec_real import BS, assert_same, chat_prompt, run_to_completion

pytestmark = pytest.mark.slow

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity."
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=BS, max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> dict[str, list[int]]:
    return {
        "grounded": chat_prompt(llm, f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"),
        "free": chat_prompt(llm, "Write a short poem about the sea."),
    }


def test_greedy_output_and_logprobs_are_unchanged_and_grounded_drafts_are_accepted(
    llm: LLM, prompts: dict[str, list[int]]
) -> None:
    """One plain and one speculative run (each costs seconds on CPU): tokens, stop handling and
    logprobs (top-3 on the grounded prompt, the sampled token's alone on the free one)."""
    requests = {
        "grounded": (prompts["grounded"], SamplingParams(temperature=0, max_tokens=40, logprobs=3)),
        "free": (prompts["free"], SamplingParams(temperature=0, max_tokens=24, logprobs=0)),
        # max_tokens inside a step's k + 1 tokens, and a stop string mid-passage
        "short": (prompts["grounded"], SamplingParams(temperature=0, max_tokens=7)),
        "stop": (prompts["grounded"], SamplingParams(temperature=0, max_tokens=40, stop=["age of"])),
    }
    plain, _ = run_to_completion(llm, None, requests)
    spec, engine = run_to_completion(llm, SPEC, requests)
    assert_same(plain, spec)
    for rid in ("grounded", "free"):
        _same_logprobs(plain[rid], spec[rid])
    assert len(spec["short"].token_ids) == 7 and spec["short"].finish_reason == "length"
    assert spec["stop"].stop_reason == "age of"
    stats = engine.get_stats()
    assert stats.spec_num_drafts_total > 0
    assert stats.spec_num_accepted_tokens_total > 0.5 * stats.spec_num_draft_tokens_total  # grounded
    assert stats.generation_tokens_total == sum(len(o.token_ids) for o in spec.values())


def test_free_prompt_alone_is_unchanged(llm: LLM, prompts: dict[str, list[int]]) -> None:
    requests = {"free": (prompts["free"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))}
    plain, _ = run_to_completion(llm, None, requests)
    spec, _ = run_to_completion(llm, SPEC, requests)
    assert_same(plain, spec)


def test_seeded_sampling_with_speculation_reproduces(llm: LLM, prompts: dict[str, list[int]]) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=24)
    requests = {"grounded": (prompts["grounded"], params)}
    first, engine = run_to_completion(llm, SPEC, requests)
    again, _ = run_to_completion(llm, SPEC, requests)
    assert_same(first, again)
    assert engine.get_stats().spec_num_drafts_total > 0


ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["name", "qty"],
            },
        },
    },
    "required": ["customer", "items"],
}
ORDER_TEXT = (
    '{"customer": "Ada Lovelace", "items": [{"name": "apple", "qty": 3}, {"name": "pear", "qty": 4}, '
    '{"name": "plum", "qty": 12}]}'
)


def test_json_schema_output_is_unchanged_and_drafts_are_accepted(llm: LLM) -> None:
    """Drafts are cut where the grammar forbids them and each position is verified under its
    own mask: the constrained greedy output is token for token plain decoding's."""
    import json

    from kvgate.engine.structured import StructuredOutputSpec

    tok = llm.get_tokenizer()
    prompt = list(
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Return this order as JSON, exactly:\n\n{ORDER_TEXT}"}]
            )
        )
    )
    schema = StructuredOutputSpec.json_schema(ORDER)
    requests = {
        "json": (prompt, SamplingParams(temperature=0, max_tokens=80, structured_outputs=schema)),
        "json_lp": (
            prompt,
            SamplingParams(temperature=0, max_tokens=80, logprobs=2, structured_outputs=schema),
        ),
    }
    plain, _ = run_to_completion(llm, None, requests)
    spec, engine = run_to_completion(llm, SPEC, requests)
    assert_same(plain, spec)
    _same_logprobs(plain["json_lp"], spec["json_lp"])
    assert spec["json"].finish_reason == "stop"
    json.loads(spec["json"].text)
    stats = engine.get_stats()
    assert stats.spec_num_drafts_total > 0 and stats.spec_num_accepted_tokens_total > 0


def _same_logprobs(a: RequestOutput, b: RequestOutput) -> None:
    assert a.logprobs is not None and b.logprobs is not None
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
        assert pb.sampled.token_id == pa.sampled.token_id
        # a verification chunk and a decode step compute in another order: float tolerance
        assert pb.sampled.logprob == pytest.approx(pa.sampled.logprob, abs=1e-3)
        assert [t.token_id for t in pb.top] == [t.token_id for t in pa.top]
        assert [t.logprob for t in pb.top] == pytest.approx([t.logprob for t in pa.top], abs=1e-3)
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-2)

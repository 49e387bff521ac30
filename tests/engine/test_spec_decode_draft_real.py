"""The draft_model proposer over the REAL default model on CPU: the default model drafting for
itself (its drafts are its own greedy tokens: acceptance ~1) and a truncated copy of it (first
28 of 30 layers, its final norm and lm head); greedy output with either is token for token the
output without speculation, and the draft's own paged KV cache is given back."""

from __future__ import annotations

import pytest

from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode import SpeculativeConfig
from kvgate.engine.spec_decode.draft_model import DraftModelError, DraftModelProposer
from kvgate.engine.structured import StructuredOutputSpec
from tests.engine.spec_real import BS, chat_prompt, run_to_completion

pytestmark = pytest.mark.slow

SELF = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", adaptive=False)
TRUNCATED = SpeculativeConfig(
    num_speculative_tokens=3, method="draft_model", draft_num_layers=28, adaptive=False
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=BS, max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> dict[str, list[int]]:
    return {
        "poem": chat_prompt(llm, "Write a short poem about the sea."),
        "list": chat_prompt(llm, "Name five fruits, one per line."),
    }


def _run(
    llm: LLM, spec: SpeculativeConfig | None, requests: dict[str, tuple[list[int], SamplingParams]]
) -> tuple[dict[str, RequestOutput], LLMEngine]:
    out, engine = run_to_completion(llm, spec, requests)
    proposer = engine.scheduler.proposer
    if proposer is not None:  # the draft's blocks all came back
        assert isinstance(proposer, DraftModelProposer)
        assert proposer.num_free_blocks == proposer.num_blocks and not proposer.block_tables
    return out, engine


REQUESTS = {
    "poem": ("poem", SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)),
    "list": ("list", SamplingParams(temperature=0, max_tokens=24)),
    "short": ("poem", SamplingParams(temperature=0, max_tokens=6)),  # max_tokens inside a step
    "stop": ("list", SamplingParams(temperature=0, max_tokens=24, stop=["\n"])),
    "lp": ("poem", SamplingParams(temperature=0, max_tokens=12, logprobs=2)),
    # the grammar cuts the draft's proposals; each position verified under its own mask
    "json": (
        "list",
        SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=StructuredOutputSpec.json_schema(
                {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}}}
            ),
        ),
    ),
}


def test_self_draft_and_a_truncated_draft_leave_greedy_output_unchanged(
    llm: LLM, prompts: dict[str, list[int]]
) -> None:
    requests = {rid: (prompts[p], params) for rid, (p, params) in REQUESTS.items()}
    plain, _ = _run(llm, None, requests)
    for spec in (SELF, TRUNCATED):
        out, engine = _run(llm, spec, requests)
        for rid in requests:
            assert out[rid].token_ids == plain[rid].token_ids, (spec.draft_num_layers, rid)
            assert (out[rid].text, out[rid].finish_reason) == (plain[rid].text, plain[rid].finish_reason)
        lp, plain_lp = out["lp"].logprobs or [], plain["lp"].logprobs or []
        assert [p.sampled.logprob for p in lp] == pytest.approx(
            [p.sampled.logprob for p in plain_lp], abs=1e-3
        )
        stats = engine.get_stats()
        assert stats.spec_num_drafts_total > 0
        if spec is SELF:  # its drafts are the target's own greedy tokens
            assert stats.spec_num_accepted_tokens_total >= 0.9 * stats.spec_num_draft_tokens_total, stats
        else:
            assert stats.spec_num_accepted_tokens_total > 0, stats


def test_the_draft_cache_follows_accepted_tokens(llm: LLM, prompts: dict[str, list[int]]) -> None:
    """Self-drafting, the drafts are the target's greedy continuation; after 'accepting' two of
    them (the draft's KV for the other two is stale past the sequence), the next proposal
    continues from the accepted tokens exactly."""
    prompt = prompts["poem"]
    plain, _ = _run(llm, None, {"a": (prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))})
    greedy = plain["a"].token_ids
    proposer = DraftModelProposer.build(llm.engine.runner, SELF)
    assert proposer.propose([("a", prompt, 4)]) == {"a": greedy[:4]}
    assert proposer.num_computed["a"] == len(prompt)
    assert proposer.propose([("a", prompt + greedy[:3], 4)]) == {"a": greedy[3:7]}
    assert proposer.propose([("a", prompt + greedy[:5], 3), ("b", prompt, 2)]) == {
        "a": greedy[5:8],
        "b": greedy[:2],
    }
    proposer.release("a")
    proposer.release("b")
    assert proposer.num_free_blocks == proposer.num_blocks


def test_a_draft_with_more_layers_than_it_has_is_refused(llm: LLM) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=2, method="draft_model", draft_num_layers=31)
    with pytest.raises(DraftModelError, match="draft_num_layers 31"):
        DraftModelProposer.build(llm.engine.runner, spec)

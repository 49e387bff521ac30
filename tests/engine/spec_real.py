"""What the speculative-decoding tests on the real default model share: an engine over the
already loaded runner, run to completion with and without speculation, and the comparison of
their outputs."""

from __future__ import annotations

from kvgate.engine.config import EngineConfig
from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode import SpeculativeConfig

BS = 16


def chat_prompt(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return list(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))


def run_to_completion(
    llm: LLM, spec: SpeculativeConfig | None, requests: dict[str, tuple[list[int], SamplingParams]]
) -> tuple[dict[str, RequestOutput], LLMEngine]:
    """Every request's final output; the streamed deltas add up to its text, and no KV block is
    left held."""
    engine = LLMEngine(
        EngineConfig(block_size=BS, max_model_len=1024, speculative_config=spec),
        runner=llm.engine.runner,
        tokenizer=llm.get_tokenizer(),
    )
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, RequestOutput] = {}
    streamed: dict[str, str] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            streamed[o.request_id] = streamed.get(o.request_id, "") + o.delta_text
            if o.finished:
                out[o.request_id] = o
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    for rid, o in out.items():
        assert streamed[rid] == o.text
    return out, engine


def assert_same(a: dict[str, RequestOutput], b: dict[str, RequestOutput]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert b[rid].token_ids == a[rid].token_ids, rid
        assert (b[rid].text, b[rid].finish_reason, b[rid].stop_reason) == (
            a[rid].text,
            a[rid].finish_reason,
            a[rid].stop_reason,
        ), rid

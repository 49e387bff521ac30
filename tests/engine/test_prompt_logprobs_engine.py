"""Prompt logprobs through the scheduler and engine (simulated runner): chunked prefill,
preemption by recompute and prefix caching give each prompt position exactly once."""

from __future__ import annotations

from typing import Any

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import PromptTokenLogprobs, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

BS = 16


def _engine(tok: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(simulate=True, block_size=BS, simulation=SimulationConfig(time_scale=0), **kw)
    return LLMEngine(cfg, tokenizer=tok)


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def _workload(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[RequestOutput]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, prompt_logprobs=2))
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def _key(e: PromptTokenLogprobs | None) -> Any:
    return None if e is None else (e.token.token_id, e.token.logprob, e.rank, [t.token_id for t in e.top])


def test_each_prompt_position_once_under_chunking_and_preemption(tok: Any) -> None:
    prompts = [_prompt(i, 40 + 7 * i) for i in range(6)]
    baseline = _workload(_engine(tok, num_kv_blocks=256), prompts)
    tiny = _engine(tok, num_kv_blocks=10, max_num_batched_tokens=24)  # 160 tokens for ~400 wanted
    pressured = _workload(tiny, prompts)
    assert tiny.get_stats().num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        carrying = [o for o in pressured[rid] if o.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is pressured[rid][0]  # the first output, once
        got = carrying[0].prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        assert [e.token.token_id for e in got[1:] if e is not None] == prompt[1:]
        (expected,) = [o.prompt_logprobs for o in baseline[rid] if o.prompt_logprobs is not None]
        assert expected is not None
        assert [_key(e) for e in got] == [_key(e) for e in expected]
        assert all(e is not None and len(e.top) == 2 for e in got[1:])


def test_prompt_logprobs_skip_the_prefix_cache_others_keep_it(tok: Any) -> None:
    engine = _engine(tok, num_kv_blocks=64)
    prompt = _prompt(3, 70)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("asks", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1))
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step()})
    assert finals["asks"].num_cached_tokens == 0
    assert finals["plain"].num_cached_tokens == 64
    lps = finals["asks"].prompt_logprobs
    assert lps is not None and len(lps) == 70 and all(e is not None and e.top == [] for e in lps[1:])

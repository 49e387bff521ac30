"""Adaptive speculation (engine/spec_decode/adaptive.py): the k rule, the acceptance estimate,
the step-cost fit, re-probing, and on the simulated runner with a CPU-like cost: a workload
whose drafts are mostly rejected stops drafting, a repeating one keeps drafting, and one that
turns repetitive later drafts again; greedy output never changes."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.runner_api import SampledToken, ScheduledBatch
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner, _mix
from kvgate.engine.spec_decode import SpeculativeConfig
from kvgate.engine.spec_decode.adaptive import (
    AcceptanceEstimate,
    AdaptiveConfig,
    AdaptiveSpeculator,
    StepCostModel,
    choose_k,
)

# -- the rule ----------------------------------------------------------------------------------


def test_choose_k_takes_drafts_while_their_expected_gain_beats_their_cost() -> None:
    assert choose_k(0.9, 4, 0.1) == 4  # 0.9^4 = 0.66 > 0.1
    assert choose_k(0.1, 4, 0.2) == 0  # even the first draft is worth less than it costs
    assert choose_k(0.5, 4, 0.2) == 2  # 0.5, 0.25 pay; 0.125 does not
    assert choose_k(0.5, 4, 0.2, margin=2.0) == 1
    assert choose_k(0.05, 4, 0.0) == 4  # drafts free (a GPU's decode): any acceptance pays
    assert choose_k(0.0, 4, 0.0) == 0
    assert choose_k(0.99, 0, 0.0) == 0


def test_acceptance_starts_optimistic_and_follows_the_per_position_rate() -> None:
    cfg = AdaptiveConfig()
    est = AcceptanceEstimate.prior(cfg)
    assert est.alpha == pytest.approx(cfg.prior_alpha)
    for _ in range(30):  # 1 of 4 accepted: 2 positions tested, 1 accepted
        est.observe(4, 1, cfg.decay)
    assert est.alpha == pytest.approx(0.5, abs=0.01)
    for _ in range(30):  # all accepted: 4 tested, 4 accepted
        est.observe(4, 4, cfg.decay)
    assert est.alpha > 0.99
    for _ in range(30):
        est.observe(4, 0, cfg.decay)
    assert est.alpha < 0.01


def test_step_cost_is_fit_from_timings() -> None:
    model = StepCostModel()
    assert model.draft_cost(1, 1) == 0.0  # nothing measured: drafts look free
    for i in range(200):
        tokens = 4 + i % 5  # batch 4, 0..4 drafts
        noise = 0.0005 * ((i * 7919) % 11 - 5) / 5
        model.observe(tokens, 0.050 + 0.004 * tokens + noise)
    assert model.a == pytest.approx(0.050, abs=0.003)
    assert model.b == pytest.approx(0.004, abs=0.0005)
    # one more token in a step of 4 seqs, 4 tokens: 0.004 * 4 / 0.066
    assert model.draft_cost(4, 4) == pytest.approx(0.004 * 4 / 0.066, rel=0.1)
    # tokens stop varying (nobody drafts): the slope is kept, not lost to a zero spread
    for _ in range(1000):
        model.observe(4, 0.066)
    assert model.b == pytest.approx(0.004, abs=0.0005)
    assert model.step_seconds(4) == pytest.approx(0.066, abs=0.002)


def test_until_the_cost_is_fit_every_fourth_step_drafts_nothing() -> None:
    spec = AdaptiveSpeculator()
    est = spec.new_estimate()
    ks = []
    for _ in range(4):
        spec.begin_step()
        ks.append(spec.num_drafts(est, 4, 1, 1, 1))
        if ks[-1]:  # drafting steps all cost alike: no slope yet
            spec.observe_step(1 + ks[-1], 0.05 + 0.01 * (1 + ks[-1]))
            assert not spec.cost.has_slope
    assert ks == [4, 4, 4, 0]
    spec.observe_step(1, 0.06)  # the plain step gives the slope
    assert spec.cost.has_slope and spec.cost.b == pytest.approx(0.01)
    spec.begin_step()
    assert not spec.exploring


def test_a_request_that_stopped_drafting_is_re_probed() -> None:
    cfg = AdaptiveConfig(probe_drafts=2, probe_overhead=0.02, min_probe_interval=4, long_match=3)
    spec = AdaptiveSpeculator(cfg)
    for tokens in (1, 5) * 20:  # batch 1: a = 0.05, b = 0.01 -> a draft costs 0.01 / 0.06
        spec.observe_step(tokens, 0.05 + 0.01 * tokens)
    cost = spec.cost.draft_cost(1, 1)
    assert cost == pytest.approx(0.01 / 0.06)
    # a probe of 2 drafts every ceil(2 * cost / 0.02) = 17 proposals: 2% of the steps' time
    assert spec.probe_interval(cost, 1) == 17 and spec.probe_interval(cost, 3) == 8
    assert spec.probe_interval(0.0, 1) == 4  # drafts nearly free (a GPU): probe often
    good = spec.new_estimate()
    assert spec.num_drafts(good, 4, 1, 1, 1) == 4  # optimistic start
    bad = spec.new_estimate()
    for _ in range(10):
        spec.observe_acceptance(bad, 4, 0)
    ks = [spec.num_drafts(bad, 4, 1, 1, 1) for _ in range(34)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [16, 33] and all(ks[i] == 2 for i in probes)
    # long n-gram matches: sooner
    assert [spec.num_drafts(bad, 4, 3, 1, 1) for _ in range(8)] == [0] * 7 + [2]
    for _ in range(2):  # the probes find the request grounded now: the rule drafts again
        spec.observe_acceptance(bad, 2, 2)
    assert spec.num_drafts(bad, 4, 1, 1, 1) >= 1


def test_config_key_adaptive() -> None:
    base = '{"method": "ngram", "num_speculative_tokens": 4'
    assert SpeculativeConfig.from_json(base + "}").adaptive is True
    assert SpeculativeConfig.from_json(base + ', "adaptive": false}').adaptive is False
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig.from_json(base + ', "adaptive": 1}')


# -- on the simulated runner -------------------------------------------------------------------


class _Tok:
    eos_token_id = 2
    eos_token_ids = (2,)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class _Runner(SimulatedRunner):
    """A fake model: `kind` "free" draws each token from 8 symbols by a hash (1-gram matches
    everywhere, drafts right about 1 in 8), "pattern" repeats a 5-token cycle with a deviation
    every 13th token, "late" is free for its first 60 tokens, then the pattern. Records, per
    step, each seq's (position, drafts)."""

    def __init__(self, cfg: EngineConfig, kind: str) -> None:
        super().__init__(cfg, sleep=lambda _s: None)
        self.kind = kind
        self.steps_seen: list[list[tuple[int, int]]] = []

    def _token(self, params: SamplingParams, key: int, pos: int) -> tuple[int, int]:
        if self.kind == "free" or (self.kind == "late" and pos < 60):
            return 300 + _mix(key ^ _mix(pos)) % 8, key
        cycle = [300, 301, 302, 303, 304]
        return (400 + pos % 3 if pos % 13 == 12 else cycle[pos % len(cycle)]), key

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        self.steps_seen.append([(s.num_generated, len(s.draft_token_ids)) for s in batch.seqs])
        return super().execute(batch)


# CPU-like: every token computed costs 10 ms on top of a 50 ms step (b large), a decoding
# sequence as much as a draft; the default timing makes drafts nearly free (a GPU's decode)
CPU_LIKE = SimulationConfig(itl_base=0.04, itl_per_seq=0.01, prefill_time_per_token=0.01)


def _engine(kind: str, spec: SpeculativeConfig | None) -> tuple[LLMEngine, _Runner]:
    cfg = EngineConfig(
        simulate=True,
        block_size=4,
        max_model_len=512,
        num_kv_blocks=256,
        simulation=CPU_LIKE,
        speculative_config=spec,
    )
    runner = _Runner(cfg, kind)
    return LLMEngine(cfg, runner=runner, tokenizer=_Tok()), runner


def _run(kind: str, spec: SpeculativeConfig | None, n: int = 1, max_tokens: int = 160) -> dict[str, Any]:
    engine, runner = _engine(kind, spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [300, 301, 302, 303, 304, 300, 301, 5], params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    assert engine.get_stats().kv_cache_usage == 0.0
    decode = [(pos, k) for step in runner.steps_seen for pos, k in step if pos > 0]
    return {
        "out": out,
        "engine": engine,
        "decode": decode,
        "drafting": sum(1 for _, k in decode if k) / len(decode),
        "seconds": runner.simulated_seconds,
    }


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
FIXED = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, adaptive=False)


@pytest.mark.parametrize("n", [1, 4])
def test_a_free_workload_stops_drafting_and_a_repeating_one_keeps_on(n: int) -> None:
    plain_free = _run("free", None, n)
    free = _run("free", SPEC, n)
    fixed_free = _run("free", FIXED, n)
    assert free["out"] == plain_free["out"] == fixed_free["out"]
    assert fixed_free["drafting"] > 0.8  # nearly every step has a 1-gram match
    assert free["drafting"] < 0.25  # the first steps, the re-probes and what they find
    # drafts that are mostly rejected cost time; adaptive gives nearly all of it back
    assert fixed_free["seconds"] > 1.2 * plain_free["seconds"]
    assert free["seconds"] < 1.1 * plain_free["seconds"]

    plain_pattern = _run("pattern", None, n)
    pattern = _run("pattern", SPEC, n)
    assert pattern["out"] == plain_pattern["out"]
    # at batch 4 a draft costs 0.44 of a token's time here (c = b*N / (a + b*T)), and the rule
    # drafts only where alpha^j > 1.5 c: the pattern's runs between deviations
    assert pattern["drafting"] > {1: 0.8, 4: 0.25}[n]
    assert pattern["seconds"] < {1: 0.7, 4: 1.0}[n] * plain_pattern["seconds"]
    # the simulated runner's configured cost: a draft token costs prefill_time_per_token
    cost = pattern["engine"].scheduler.adaptive.cost
    assert cost.b == pytest.approx(CPU_LIKE.prefill_time_per_token, rel=0.05)


def test_a_request_that_turns_repetitive_drafts_again() -> None:
    plain = _run("late", None, max_tokens=240)
    late = _run("late", SPEC, max_tokens=240)
    assert late["out"] == plain["out"]
    free_part = [k for pos, k in late["decode"] if 20 <= pos < 60]
    later = [k for pos, k in late["decode"] if pos >= 120]
    assert sum(1 for k in free_part if k) / len(free_part) < 0.25
    assert sum(1 for k in later if k) / len(later) > 0.8


def test_off_without_a_cost_drafts_fully() -> None:
    # the default simulation with time_scale 0 costs nothing: adaptive drafts as fixed does
    cfg = EngineConfig(
        simulate=True,
        block_size=4,
        max_model_len=512,
        simulation=SimulationConfig(time_scale=0),
        speculative_config=SPEC,
    )
    runner = _Runner(cfg, "free")
    engine = LLMEngine(cfg, runner=runner, tokenizer=_Tok())
    engine.add_request(
        "a",
        [300, 301, 302, 303, 304, 300, 301, 5],
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    )
    while engine.has_unfinished_requests():
        engine.step()
    decode = [k for step in runner.steps_seen for pos, k in step if pos > 0]
    assert sum(1 for k in decode if k) / len(decode) > 0.8

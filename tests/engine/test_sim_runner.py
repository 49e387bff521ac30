"""The simulated runner: timing model, deterministic word-like tokens, logprobs, no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.runner_api import ScheduledBatch, ScheduledSeq
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner


def _seq(
    rid: str, n_tokens: int, start: int, generated: int, params: SamplingParams | None = None
) -> ScheduledSeq:
    return ScheduledSeq(
        rid, [7] * n_tokens, start, [], True, params or SamplingParams(), num_generated=generated
    )


def test_step_duration_follows_the_timing_model() -> None:
    sim = SimulationConfig(prefill_time_per_token=0.001, itl_base=0.01, itl_per_seq=0.002, time_scale=0.5)
    slept: list[float] = []
    runner = SimulatedRunner(EngineConfig(simulation=sim), sleep=slept.append)
    batch = ScheduledBatch([_seq("a", 100, 0, 0), _seq("b", 1, 50, 3), _seq("c", 1, 60, 9)])
    runner.execute(batch)
    assert slept == [pytest.approx((0.001 * 100 + 0.01 + 0.002 * 2) * 0.5)]
    runner.execute(ScheduledBatch([]))
    assert len(slept) == 1  # an empty step costs nothing
    assert runner.num_kv_blocks == sim.num_kv_blocks
    assert SimulatedRunner(EngineConfig(num_kv_blocks=7, simulation=sim)).num_kv_blocks == 7


def test_tokens_are_words_and_depend_only_on_seed_or_id_and_position(tok: Any) -> None:
    cfg = EngineConfig(simulation=SimulationConfig(time_scale=0))
    runner = SimulatedRunner(cfg, tok, eos_token_id=tok.eos_token_id)

    def tokens(rid: str, params: SamplingParams, n: int = 12) -> list[int]:
        return [
            runner.execute(ScheduledBatch([_seq(rid, 1, 100 + k, k, params)]))[0].token_id for k in range(n)
        ]

    p = SamplingParams(max_tokens=12)
    a = tokens("a", p)
    assert a == tokens("a", p) and a != tokens("b", p)
    seeded = SamplingParams(max_tokens=12, seed=5)
    assert tokens("x", seeded) == tokens("y", seeded)
    text = tok.decode(a)
    assert len(text.split()) == 12 and all(w.isalpha() and w.islower() for w in text.split())
    assert tok.eos_token_id not in a
    # Without max_tokens, a simulated answer ends on its own with EOS.
    endless = tokens("a", SamplingParams(max_tokens=None), n=300)
    assert tok.eos_token_id in endless
    assert tok.eos_token_id not in tokens("a", SamplingParams(max_tokens=None, ignore_eos=True), n=300)
    assert runner.vocab_size == tok.vocab_size


def test_fake_logprobs_are_well_formed(tok: Any) -> None:
    runner = SimulatedRunner(EngineConfig(simulation=SimulationConfig(time_scale=0)), tok)
    for n in (0, 1, 5):
        (s,) = runner.execute(ScheduledBatch([_seq("a", 1, 10, 2, SamplingParams(logprobs=n))]))
        assert s.logprob is not None and s.logprob < 0
        assert s.top_logprobs is not None and len(s.top_logprobs) == n
        values = [lp for _, lp in s.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
        assert len({t for t, _ in s.top_logprobs}) == n
        if n:
            assert s.top_logprobs[0] == (s.token_id, s.logprob)
    (plain,) = runner.execute(ScheduledBatch([_seq("a", 1, 10, 2)]))
    assert plain.logprob is None and plain.top_logprobs is None


def test_the_simulate_path_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from kvgate.engine import LLM, SamplingParams\n"
        "from kvgate.engine.config import SimulationConfig\n"
        "llm = LLM(simulate=True, simulation=SimulationConfig(time_scale=0))\n"
        "out = llm.generate('hi', SamplingParams(max_tokens=3))\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

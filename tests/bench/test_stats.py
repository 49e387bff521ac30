"""Latency statistics, goodput and the best achievable prefix-cache hit rate."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.bench.stats import RequestResult, Slo, ideal_prefix_hit_rate, percentile, summarize
from kvgate.bench.workloads import SharedPrefixSpec, WorkloadSpec, generate


@given(
    st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=200),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_percentile_of_nothing_is_none_and_bad_q_fails() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _ok(index: int, ttft: float, gaps: list[float], tokens: int | None = None) -> RequestResult:
    times = list(itertools.accumulate([ttft, *gaps]))
    return RequestResult(
        index=index,
        group="g",
        sent_at=float(index),
        status=200,
        ttft=ttft,
        token_times=times,
        e2e=times[-1] + 0.001,
        output_tokens=tokens if tokens is not None else len(times),
    )


def test_summary_percentiles_throughput_goodput_and_errors() -> None:
    results = [_ok(i, ttft=0.1 * (i + 1), gaps=[0.02] * 9) for i in range(10)]
    results.append(RequestResult(index=10, group="g", sent_at=10.0, status=429, error="HTTP 429: busy"))
    results.append(RequestResult(index=11, group="g", sent_at=11.0, status=None, error="ConnectError"))
    s = summarize("rr", results, duration_s=5.0, slo=Slo(ttft_s=0.5, itl_s=0.05))
    assert (s.requests, s.completed, s.errors) == (12, 10, 2)
    assert s.status_counts == {"200": 10, "429": 1, "conn-error": 1}
    assert s.ttft_p50_s == pytest.approx(0.55)
    assert s.ttft_p90_s == pytest.approx(float(np.percentile([0.1 * (i + 1) for i in range(10)], 90)))
    assert s.itl_p50_s == pytest.approx(0.02)
    assert s.output_tok_s == pytest.approx(100 / 5.0)
    # TTFT ≤ 0.5 s: requests 0..4 (ttft 0.1..0.5), all with ITL 20 ms ≤ 50 ms.
    assert s.goodput_req_s == pytest.approx(5 / 5.0)
    assert s.goodput_frac == pytest.approx(5 / 12)


def test_slo_rejects_slow_decoding_even_with_fast_first_token() -> None:
    slow = _ok(0, ttft=0.05, gaps=[0.2] * 5)
    assert not Slo(ttft_s=0.5, itl_s=0.05).met_by(slow)
    assert Slo(ttft_s=0.5, itl_s=0.5).met_by(slow)


def test_ideal_hit_rate_is_zero_without_sharing_and_counts_full_blocks_only() -> None:
    assert ideal_prefix_hit_rate([[1, 2, 3, 4], [5, 6, 7, 8]], block_size=2) == 0.0
    # Second prompt repeats the first 5 tokens: 2 full blocks (4 tokens) of 2 can hit; the
    # partial third block cannot.
    assert ideal_prefix_hit_rate([[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 7]], block_size=2) == pytest.approx(
        4 / 12
    )
    # An identical prompt whose length is a whole number of blocks still computes its last block.
    assert ideal_prefix_hit_rate([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=2) == pytest.approx(2 / 8)
    # A block only hits when its whole chain did: same 2nd block after a different 1st misses.
    assert ideal_prefix_hit_rate([[1, 2, 3, 4, 0], [9, 9, 3, 4, 0]], block_size=2) == 0.0
    assert ideal_prefix_hit_rate([], block_size=16) is None


def test_ideal_hit_rate_equals_the_closed_form_for_shared_prefix() -> None:
    """1 − (unique prefix tokens + all suffix tokens) / total prompt tokens, at block granularity."""
    groups, prefix, suffix, n = 6, 160, 24, 200
    spec = WorkloadSpec(
        kind="shared-prefix",
        seed=3,
        shared_prefix=SharedPrefixSpec(groups=groups, prefix_tokens=prefix, suffix_tokens=suffix),
    )
    reqs = list(itertools.islice(generate(spec), n))
    got = ideal_prefix_hit_rate([r.nominal_words for r in reqs], block_size=16)
    seen_groups = {r.group for r in reqs}
    total = n * (prefix + suffix)
    # prefix is a whole number of blocks (160 = 10 × 16), so each repeat hits the whole prefix.
    closed_form = 1 - (len(seen_groups) * prefix + n * suffix) / total
    assert got == pytest.approx(closed_form)


def test_ideal_hit_rate_never_exceeds_what_a_random_router_would_get_on_one_engine() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 60))] for _ in range(50)]
    rate = ideal_prefix_hit_rate(prompts, block_size=4)
    assert rate is not None and 0.0 <= rate < 1.0


def test_ideal_hit_rate_counts_warmup_history_as_already_cached() -> None:
    warm = [[1, 2, 3, 4, 9]]
    measured = [[1, 2, 3, 4, 5]]
    assert ideal_prefix_hit_rate(measured, block_size=2) == 0.0
    assert ideal_prefix_hit_rate(measured, block_size=2, history=warm) == pytest.approx(4 / 5)

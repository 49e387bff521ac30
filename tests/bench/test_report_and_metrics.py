"""Reading engine counters, the table, the JSON records and the charts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.api.contracts import metrics as m
from kvgate.bench import plots, report
from kvgate.bench.engine_metrics import CounterSnapshot, hit_rate, parse_samples
from kvgate.bench.session import verdict_lines
from kvgate.bench.stats import RequestResult, Slo, summarize

PROM_TEXT = f"""# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
{m.PREFIX_CACHE_HITS_TOTAL}{{engine="0",model_name="m"}} 300.0
{m.PREFIX_CACHE_HITS_TOTAL}{{engine="1",model_name="m"}} 100.0
{m.PREFIX_CACHE_QUERIES_TOTAL}{{engine="0",model_name="m"}} 1000.0
{m.PREFIX_CACHE_QUERIES_TOTAL}{{engine="1",model_name="m",note="a}} b"}} 1000.0
{m.NUM_REQUESTS_RUNNING} 3
vllm:cache_config_info{{block_size="16",num_gpu_blocks="512"}} 1.0
garbage line without value
"""


def test_parse_samples_sums_label_sets_and_skips_junk() -> None:
    s = parse_samples(PROM_TEXT)
    assert s[m.PREFIX_CACHE_HITS_TOTAL] == 400.0
    assert s[m.PREFIX_CACHE_QUERIES_TOTAL] == 2000.0
    assert s[m.NUM_REQUESTS_RUNNING] == 3.0
    assert "garbage" not in s


def test_hit_rate_from_counter_deltas() -> None:
    before = CounterSnapshot({m.PREFIX_CACHE_HITS_TOTAL: 100, m.PREFIX_CACHE_QUERIES_TOTAL: 1000}, 2)
    after = CounterSnapshot({m.PREFIX_CACHE_HITS_TOTAL: 850, m.PREFIX_CACHE_QUERIES_TOTAL: 2000}, 2)
    assert hit_rate(after.minus(before)) == pytest.approx(0.75)
    assert hit_rate(before.minus(before)) is None


def _summary(name: str, ttft: float, tok: int = 10, hit: float | None = 0.5):
    results = [
        RequestResult(i, "g", float(i), 200, ttft, [ttft, ttft + 0.01], ttft + 0.02, 100, tok)
        for i in range(20)
    ]
    s = summarize(name, results, 2.0, Slo())
    s.prefix_hit_rate = hit
    s.ideal_prefix_hit_rate = 0.9
    return s, results


def test_text_and_markdown_tables_show_every_strategy() -> None:
    rr, _ = _summary("round-robin", 0.8)
    pp, _ = _summary("precise-prefix", 0.05, hit=0.88)
    table = report.text_table([rr, pp])
    lines = table.splitlines()
    assert lines[0].startswith("strategy") and "TTFT p90 ms" in lines[0]
    assert lines[2].startswith("round-robin") and "800.0" in lines[2]
    assert "88.0%" in lines[3]
    md = report.markdown_table([rr, pp])
    assert md.count("\n") == 3 and md.startswith("| strategy |")


def test_json_has_one_record_per_strategy_with_the_required_keys(tmp_path: Path) -> None:
    rr, _ = _summary("round-robin", 0.8)
    pp, _ = _summary("precise-prefix", 0.05)
    path = tmp_path / "out" / "r.json"
    report.write_json(path, [rr, pp], {"seed": 0})
    doc = json.loads(path.read_text())
    assert [r["strategy"] for r in doc] == ["round-robin", "precise-prefix"]
    for key in (
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "itl_p50_s",
        "output_tok_s",
        "prefix_hit_rate",
        "errors",
    ):
        assert key in doc[0], key
    assert doc[0]["settings"] == {"seed": 0}


def test_verdict_states_ratios_against_each_other_strategy() -> None:
    rr, _ = _summary("round-robin", 0.8)
    pp, _ = _summary("precise-prefix", 0.08, hit=0.81)
    lines = verdict_lines([rr, pp])
    assert any("0.10× round-robin" in line for line in lines)
    assert any("90% of the best achievable" in line for line in lines)


def test_charts_are_written_as_png(tmp_path: Path) -> None:
    rr, rr_results = _summary("round-robin", 0.8)
    pp, pp_results = _summary("precise-prefix", 0.05)
    rr.request_rate, pp.request_rate = 4.0, 4.0
    paths = [
        plots.latency_cdfs(tmp_path / "cdf.png", {"round-robin": rr_results, "precise-prefix": pp_results}),
        plots.comparison_bars(tmp_path / "cmp.png", [rr, pp], title="t"),
        plots.throughput_vs_rate(tmp_path / "tp.png", {"round-robin": [rr], "precise-prefix": [pp]}),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_compares_strategies_at_the_same_rate_only() -> None:
    """Before: the first rate's candidate row was compared with every other row, its own rows at
    other rates included, and 'best other' could be a row at another rate."""
    rows = []
    for rate, rr_ttft, pp_ttft in ((4.0, 0.8, 0.4), (24.0, 8.0, 1.0)):
        rr, _ = _summary("round-robin", rr_ttft)
        pp, _ = _summary("precise-prefix", pp_ttft)
        rr.request_rate = pp.request_rate = rate
        rows += [rr, pp]
    lines = verdict_lines(rows)
    assert not any("precise-prefix's" in line for line in lines)  # never against itself
    at_24 = [line for line in lines if "at 24 req/s" in line]
    assert any("0.12× round-robin" in line for line in at_24), lines  # 1.0 / 8.0 at one rate
    table = report.ratio_table(rows)
    assert table is not None
    body = table.splitlines()[3:]
    assert [r.split()[:2] for r in body] == [["4", "round-robin"], ["24", "round-robin"]]
    assert body[1].split()[3] == "0.12×"  # TTFT p90 at 24 req/s


def test_a_sweeps_later_rates_count_what_earlier_rates_sent_as_cached() -> None:
    # One stack serves every rate of a strategy in turn, replaying the same prompts: the best
    # achievable hit rate of the second rate counts the first's prompts as seen (it printed
    # "110% of the best achievable" when it did not).
    from kvgate.bench.compare import fill_ideal_hit_rates
    from kvgate.bench.loadgen import LoadSpec
    from kvgate.bench.runner import RunOutcome
    from kvgate.bench.workloads import SharedPrefixSpec, WorkloadSpec

    workload = WorkloadSpec(shared_prefix=SharedPrefixSpec(groups=4, prefix_tokens=64, suffix_tokens=16))
    results = [RequestResult(index=i, group="g", sent_at=0.0, status=200) for i in range(8)]

    def outcome(label: str, rate: float) -> RunOutcome:
        load = LoadSpec(request_rate=rate, num_requests=8)
        return RunOutcome(label, results, summarize(label, results, 1.0, Slo()), {}, load)

    first, second, other = outcome("a", 4.0), outcome("a", 8.0), outcome("b", 8.0)
    fill_ideal_hit_rates([first, second, other], workload, None)
    ideal = [o.summary.ideal_prefix_hit_rate for o in (first, second, other)]
    assert ideal[0] is not None and ideal[1] is not None
    assert ideal[2] == ideal[0]  # another stack: nothing seen before
    assert ideal[1] > ideal[0]  # the same prompts again: every full block was computed already

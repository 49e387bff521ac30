"""The prefill/decode bench pieces (issue 15): the long-prompt workload, the engines' transfer
counters, the P/D-vs-aggregated lines and the --pd flag's errors."""

from __future__ import annotations

import itertools

import pytest

from kvgate.bench import engine_metrics, report
from kvgate.bench.session import pd_lines
from kvgate.bench.stats import RequestResult, Slo, summarize
from kvgate.bench.workloads import LongPromptSpec, WorkloadSpec, generate
from kvgate.testing.processes import run_kvgate


def test_long_prompt_workload_mixes_unique_long_prompts_with_short_chats() -> None:
    spec = WorkloadSpec(kind="long-prompt", seed=3, long_prompt=LongPromptSpec(long_fraction=0.3))
    reqs = list(itertools.islice(generate(spec), 400))
    longs = [r for r in reqs if r.group.startswith("long-")]
    shorts = [r for r in reqs if r.group.startswith("short-")]
    assert len(longs) + len(shorts) == 400 and 0.22 < len(longs) / 400 < 0.38
    assert all(4000 <= len(r.nominal_words) <= 8000 for r in longs)
    assert all(32 <= len(r.nominal_words) <= 256 for r in shorts)
    assert len({r.nominal_words[:2] for r in reqs}) == 400  # each opens with its own tag
    assert all(r.max_tokens == 128 and r.depends_on is None for r in reqs)
    again = list(itertools.islice(generate(spec), 400))
    assert [r.messages for r in again] == [r.messages for r in reqs]
    with pytest.raises(ValueError, match="--long-fraction"):
        next(generate(WorkloadSpec(kind="long-prompt", long_prompt=LongPromptSpec(long_fraction=1.5))))
    with pytest.raises(ValueError, match="--min-long-tokens"):
        next(generate(WorkloadSpec(kind="long-prompt", long_prompt=LongPromptSpec(min_long_tokens=9000))))


CONSUMER = """# TYPE kvgate:kv_transfer_requests_total counter
kvgate:kv_transfer_requests_total{model_name="m",engine="0",role="consumer"} 3.0
kvgate:kv_transfer_bytes_total{model_name="m",engine="0",direction="received"} 3000000.0
kvgate:kv_transfer_fallbacks_total{model_name="m",engine="0",reason="timeout"} 1.0
kvgate:kv_transfer_fallbacks_total{model_name="m",engine="0",reason="refused"} 1.0
kvgate:kv_transfer_seconds_sum{model_name="m",engine="0"} 1.5
kvgate:kv_transfer_seconds_count{model_name="m",engine="0"} 3.0
"""
PRODUCER = """kvgate:kv_transfer_requests_total{model_name="m",engine="0",role="producer"} 3.0
kvgate:kv_transfer_bytes_total{model_name="m",engine="0",direction="sent"} 3000000.0
"""


def test_transfer_counters_count_each_hand_off_once() -> None:
    """A hand-off shows on both engines (sent / received, producer / consumer); the bench counts
    the consumer's side only, so the volume is not doubled."""
    consumer = engine_metrics.labelled_sums(CONSUMER)
    producer = engine_metrics.labelled_sums(PRODUCER)
    total = {k: consumer[k] + producer[k] for k in consumer}
    assert total[engine_metrics.KV_TRANSFER_RECEIVED_BYTES] == 3_000_000
    assert total[engine_metrics.KV_TRANSFERS] == 3
    assert total[engine_metrics.KV_TRANSFER_FALLBACKS] == 2
    assert total[engine_metrics.KV_TRANSFER_SECONDS] == 1.5


def _summary(name: str, ttft: float, itl: float):
    results = [
        RequestResult(
            i, "g", float(i), 200, ttft, [ttft + k * itl for k in range(6)], ttft + 5 * itl, 100, None, 6
        )
        for i in range(20)
    ]
    return summarize(name, results, 10.0, Slo(), request_rate=1.0)


def test_pd_lines_compare_the_split_with_the_aggregated_run() -> None:
    whole, split = _summary("aggregated-4", 0.5, 0.2), _summary("pd-1:3", 0.8, 0.03)
    split.kv_transfers, split.kv_transfer_bytes, split.kv_transfer_fallbacks = 6, 2.5e9, 0
    split.kv_transfer_seconds = 1.2
    (line,) = pd_lines([whole, split])
    assert line.startswith("pd-1:3 vs aggregated-4 at 1 req/s: ITL p90 30 ms vs 200 ms")
    assert "TTFT p90 800 ms vs 500 ms" in line and "6 KV hand-offs (2.5 GB pulled, 200 ms each" in line
    assert "KV pulled" in report.text_table([whole, split]) and "2.5 GB" in report.text_table([whole, split])
    assert pd_lines([whole]) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pd", "0:3"], "--pd"),
        (["--pd", "13"], "--pd"),
        (["--pd-threshold", "5"], "--pd-threshold needs --pd"),
        (["--pd", "1:1", "--compare"], "drop --compare"),
        (["--pd", "1:1", "--engines", "4"], "drop --engines"),
        (["--pd", "1:1", "--url", "http://127.0.0.1:1"], "drop --url"),
    ],
)
def test_pd_flag_errors_are_clear(args: list[str], message: str) -> None:
    r = run_kvgate("bench", "--simulate", "--no-progress", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr

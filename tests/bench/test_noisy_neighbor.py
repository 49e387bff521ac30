"""`kvgate bench --preset noisy-neighbor`'s pure parts: the runs it plans, the tenants file, each
tenant's requests, per-tenant figures and their ratios against the tenant alone, the report."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from kvgate.bench import noisy_neighbor as nn
from kvgate.bench.presets import EXPLICIT_DEST
from kvgate.bench.stats import RequestResult, Slo
from kvgate.epp.tenants import parse_tenants

CAP = nn.Capacity(2.0, 20.0, 4000, 256, 128, "test")


def _result(index: int, sent_at: float, ttft: float, tokens: int, status: int = 200) -> RequestResult:
    r = RequestResult(index=index, group=f"g{index}", sent_at=sent_at, status=status)
    if status != 200:
        r.error = f"HTTP {status}"
        return r
    r.ttft = ttft
    r.token_times = [ttft + 0.05 * i for i in range(tokens)]
    r.output_tokens = tokens
    r.e2e = r.token_times[-1]
    return r


def test_the_plan_floods_at_3x_and_keeps_the_light_tenants_at_015x_in_every_run() -> None:
    runs = nn.plan_runs(CAP, seed=7)
    assert [(r.name, r.flow_control) for r in runs] == [
        (nn.ALONE, True),
        (nn.ALONE, True),
        (nn.ALONE, True),
        (nn.FLOW, True),
        (nn.PRIO_FLOW, True),
        (nn.NO_FLOW, False),
        (nn.PRIO_NO_FLOW, False),
    ]
    loads = {(r.name, t.name): t for r in runs for t in r.tenants}
    assert {t for _, t in loads} == {"A", "B", "C", "flood", "critical"}
    for (_, name), t in loads.items():
        long = name in ("A", "flood")
        assert t.prompt_tokens == (4000 if long else 256)
        assert t.rate == pytest.approx(6.0 if long else 3.0)
        assert t.priority == {"flood": -1, "critical": 1}.get(name, 0)
    # a tenant keeps its arrival stream across runs; tenants differ from each other
    for name in ("B", "C", "critical"):
        seeds = {t.seed for (_, n), t in loads.items() if n == name}
        assert len(seeds) == 1
    assert len({t.seed for t in loads.values()}) == 5
    assert {t.name for t in runs[3].tenants} == {"A", "B", "C"} == {t.name for t in runs[5].tenants}


def test_the_tenants_file_is_valid_with_a_distinct_key_each() -> None:
    counter = itertools.count()
    text, keys = nn.tenants_file_text(list(nn.tenant_priorities()), token=lambda: f"k{next(counter):020d}")
    import yaml

    registry = parse_tenants(yaml.safe_load(text))
    assert set(registry.tenants) == {"A", "B", "C", "flood", "critical"}
    assert registry.tenants["flood"].priority == -1 and registry.tenants["critical"].priority == 1
    assert len(set(keys.values())) == 5
    for name, key in keys.items():
        tenant = registry.authenticate(f"Bearer {key}")
        assert tenant is not None and tenant.name == name
    # real keys are random
    _, one = nn.tenants_file_text(["A"])
    _, two = nn.tenants_file_text(["A"])
    assert one["A"] != two["A"]


def test_each_tenant_sends_unique_prompts_of_its_shape() -> None:
    load = nn.TenantLoad("B", 256, 3.0, priority=1, seed=2)
    reqs = list(itertools.islice(nn.tenant_requests(nn.FLOW, load, 128), 50))
    assert all(len(r.nominal_words) == 256 and r.max_tokens == 128 for r in reqs)
    assert all(r.tenant == "B" and r.priority == 1 for r in reqs)
    assert len({r.nominal_words[0] for r in reqs}) == 50  # each opens with its own tag
    again = list(itertools.islice(nn.tenant_requests(nn.FLOW, load, 128), 50))
    assert [r.messages for r in again] == [r.messages for r in reqs]
    # the same tenant in another run on the same stack: nothing for the prefix cache to reuse
    alone = next(nn.tenant_requests(nn.ALONE, load, 128))
    assert alone.messages[0].content.split()[0] != reqs[0].messages[0].content.split()[0]


def test_window_tokens_count_what_arrived_inside_the_window_failed_requests_included() -> None:
    a = _result(0, sent_at=1.0, ttft=0.5, tokens=10)  # tokens at 1.5 .. 1.95
    b = _result(1, sent_at=3.5, ttft=0.2, tokens=10)  # 3.7 .. 4.15
    b.error = "stream ended without [DONE]"  # its tokens were produced all the same
    c = _result(2, sent_at=0.0, ttft=0.0, tokens=0, status=503)
    assert nn.window_tokens([a, b, c], 0.0, 10.0) == 20
    assert nn.window_tokens([a, b, c], 1.6, 4.0) == 8 + 6
    assert nn.window_tokens([], 0.0, 1.0) == 0


def _row(run: str, tenant: str, ttft: float, tokens: int, statuses: tuple[int, ...] = ()) -> nn.TenantRow:
    load = nn.TenantLoad(tenant, 256, 3.0)
    results = [_result(i, 2.5 + 0.1 * i, ttft, tokens) for i in range(10)]
    results += [_result(10 + k, 0.5, 0.0, 0, status=s) for k, s in enumerate(statuses)]
    return nn.tenant_row(run, load, results, duration_s=5.0, window=10.0, slo=Slo())


def test_rows_ratios_and_the_pool_throughput() -> None:
    rows = [
        _row(nn.ALONE, "B", 0.2, 8),
        _row(nn.FLOW, "A", 3.0, 8, statuses=(503, 503)),
        _row(nn.FLOW, "B", 0.4, 8),
        _row(nn.NO_FLOW, "A", 3.0, 8),
        _row(nn.NO_FLOW, "B", 20.0, 4, statuses=(429, 500)),
    ]
    assert rows[1].counts() == {"sent": 12, "ok": 10, "429": 0, "503": 2, "other": 0}
    assert rows[4].counts() == {"sent": 12, "ok": 10, "429": 1, "503": 0, "other": 1}
    # 80 tokens, all of them from 2 s (the window's first fifth) to 10 s: 10 tok/s
    assert rows[0].window_tok_s == pytest.approx(80 / 8)
    assert rows[4].window_tok_s == 0.0  # its first tokens came after the window
    found = {(q.tenant, q.run): q for q in nn.ratios(rows)}
    assert set(found) == {("B", nn.FLOW), ("B", nn.NO_FLOW)}  # A never ran alone
    assert found["B", nn.FLOW].ttft_p90 == pytest.approx(2.0)
    assert found["B", nn.NO_FLOW].ttft_p50 == pytest.approx(100.0)
    assert found["B", nn.NO_FLOW].tok_s == 0.0
    assert found["B", nn.FLOW].itl_p90 == pytest.approx(1.0)
    assert nn.pool_tok_s(rows, nn.FLOW) == pytest.approx(20.0)
    assert nn.pool_tok_s(rows, nn.NO_FLOW) == pytest.approx(10.0)
    record = rows[1].record()
    assert record["run"] == nn.FLOW and record["tenant"] == "A" and record["requests_503"] == 2
    assert record["ttft_p90_s"] == pytest.approx(3.0)


def test_the_report_names_every_run_and_the_ratios(tmp_path: Path) -> None:
    rows = [
        _row(nn.ALONE, "B", 0.2, 8),
        _row(nn.ALONE, "critical", 0.1, 8),
        _row(nn.FLOW, "A", 3.0, 8, statuses=(503,)),
        _row(nn.FLOW, "B", 0.4, 8),
        _row(nn.PRIO_FLOW, "flood", 1.0, 2, statuses=(429, 429)),
        _row(nn.PRIO_FLOW, "critical", 0.3, 8),
        _row(nn.NO_FLOW, "A", 3.0, 8),
        _row(nn.NO_FLOW, "B", 20.0, 8),
        _row(nn.PRIO_NO_FLOW, "critical", 5.0, 8),
    ]
    result = nn.NoisyNeighborResult(rows, CAP, {"window_start_s": 2.0}, list(nn.FLOW_ARGS))
    table = nn.table_rows(rows)
    assert table[0][:2] == [nn.ALONE, "B"] and table[2][8] == "1"  # A's 503
    lines = nn.summary_lines(result)
    assert (
        lines[0].startswith("pool output tok/s from 2 s")
        and "flow control 20.0, none 10.0 (2.00x)" in lines[0]
    )
    assert "A's share 50% with flow control, 100% without" in lines[0]
    assert "with flow control 3.00x (300 ms), without 50.0x (5000 ms)" in lines[1]
    assert "2 of 12 refused 429" in lines[1]
    assert [r[1] for r in nn.ratio_rows(nn.ratios(rows))] == [
        nn.FLOW,
        nn.PRIO_FLOW,
        nn.NO_FLOW,
        nn.PRIO_NO_FLOW,
    ]
    assert result.all_ok_enough()
    nn.write_json(tmp_path / "r.json", result, "now")
    import json

    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["capacity"]["long_req_s"] == 2.0 and len(doc["rows"]) == 9 and len(doc["ratios"]) == 4


def test_the_flow_control_stack_runs_the_defaults_a_user_gets() -> None:
    assert nn.FLOW_ARGS == ()  # the figures are the product's, not a tuned EPP's
    assert nn.flow_args(CAP, ["--flow-short-reserve=2"]) == ["--flow-short-reserve=2"]


def _args(*argv: str) -> argparse.Namespace:
    from kvgate.bench.cli import resolve_preset
    from kvgate.cli import build_parser

    args = build_parser(["bench"], only_selected=True).parse_args(
        ["bench", "--preset", "noisy-neighbor", *argv]
    )
    resolve_preset(args)
    return args


def test_the_preset_fills_the_shape_and_refuses_what_it_cannot_do() -> None:
    args = _args("--duration", "60")
    assert getattr(args, EXPLICIT_DEST) == {"duration", "preset"}
    assert (args.simulate, args.engines, args.sim_kv_blocks, args.profile) == (True, 4, 1800, "default")
    assert (args.min_long_tokens, args.min_prompt_tokens, args.output_tokens, args.duration) == (
        4000,
        256,
        128,
        60,
    )
    nn.check_args(args)
    for argv, message in (
        (["--url", "http://127.0.0.1:1"], "starts its own stacks"),
        (["--compare"], "drop --compare"),
        (["--min-long-tokens", "100", "--max-long-tokens", "100"], "must be longer"),
    ):
        with pytest.raises(ValueError, match=message):
            nn.check_args(_args(*argv))


def test_charts_are_written(tmp_path: Path) -> None:
    from kvgate.bench import plots

    rows = [_row(nn.ALONE, "B", 0.2, 8), _row(nn.FLOW, "A", 3.0, 8), _row(nn.FLOW, "B", 0.4, 8)]
    cdf = plots.tenant_ttft_cdfs(tmp_path / "cdf.png", nn._by_tenant(rows))
    bars = plots.tenant_bars(tmp_path / "bars.png", nn._figures(rows), (nn.FLOW,))
    assert cdf.read_bytes()[:4] == bars.read_bytes()[:4] == b"\x89PNG"

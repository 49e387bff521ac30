"""`kvgate bench` end to end on simulated engines: the strategy comparison (small), a run against a
running stack's gateway, and clear errors."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest

from kvgate.bench.workloads import LongPromptSpec, WorkloadSpec, generate
from kvgate.local.ports import plan_ports
from kvgate.local.stack import LocalStack, StackConfig
from kvgate.testing.processes import run_kvgate

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = (
    "strategy",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "itl_p50_s",
    "output_tok_s",
    "prefix_hit_rate",
    "errors",
)
# A small shared-prefix workload: 3 groups × 512-token prefixes on 2 fast simulated engines.
SMALL = [
    "--simulate",
    "--engines", "2",
    "--groups", "3",
    "--prefix-tokens", "512",
    "--suffix-tokens", "16",
    "--output-tokens", "8",
    "--num-requests", "36",
    "--warmup-requests", "6",
    "--request-rate", "12",
    "--sim-time-scale", "0.5",
    "--no-progress",
]  # fmt: skip


def bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return run_kvgate("bench", *args, timeout=timeout, cwd=ROOT)


def test_compare_writes_table_json_and_charts(tmp_path: Path) -> None:
    out = bench(
        *SMALL,
        "--compare",
        "--strategies", "round-robin,precise-prefix",
        "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "charts"),
        "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.splitlines()
    assert table[0].startswith("strategy") and "TTFT p90 ms" in table[0]
    assert table[2].startswith("round-robin") and table[3].startswith("precise-prefix")
    assert "precise-prefix at " in out.stdout and "TTFT p90 = " in out.stdout
    assert "of the best achievable" in out.stdout
    assert "precise-prefix as a multiple of each other strategy at the same rate" in out.stdout
    records = json.loads((tmp_path / "r.json").read_text())
    assert [r["strategy"] for r in records] == ["round-robin", "precise-prefix"]
    for r in records:
        for key in REQUIRED:
            assert key in r, key
        assert r["errors"] == 0 and r["requests"] == 36
        assert 0 < r["ideal_prefix_hit_rate"] < 1
    rr, pp = records
    # 3 prefixes on 2 engines: round-robin computes each prefix on both, precise-prefix once.
    assert pp["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert pp["prefix_hit_rate"] >= 0.9 * pp["ideal_prefix_hit_rate"]
    for name in ("latency_cdf.png", "comparison.png"):
        assert (tmp_path / "charts" / name).read_bytes()[:4] == b"\x89PNG"
    per_request = sorted(tmp_path.glob("requests-*.jsonl"))
    assert len(per_request) == 2
    served_by = {json.loads(line)["upstream"] for line in per_request[1].read_text().splitlines()}
    assert served_by and all(u and u.startswith("127.0.0.1:") for u in served_by)  # which engine answered
    assert (tmp_path / "logs" / "precise-prefix" / "epp.log").exists()


def test_bench_against_a_running_gateway_reads_engine_metrics(tmp_path: Path) -> None:
    cfg = StackConfig(
        ports=plan_ports(0, 0, 2), engines=2, simulate=True, log_dir=tmp_path / "logs", ready_timeout_s=60
    )
    with LocalStack(cfg) as stack:
        info = stack.start()
        out = bench(
            "--stack-file", str(Path(info.log_dir) / "stack.json"),
            "--workload", "multi-turn",
            "--conversations", "3", "--turns", "3", "--first-turn-tokens", "64", "--user-turn-tokens", "16",
            "--output-tokens", "4",
            "--num-requests", "9", "--request-rate", "20", "--no-progress",
            "--json", str(tmp_path / "r.json"),
        )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (record,) = json.loads((tmp_path / "r.json").read_text())
    assert record["strategy"] == "endpoint" and record["completed"] == 9
    # Later turns resend earlier ones: the engines report prefix hits.
    assert record["prefix_hit_rate"] is not None and record["prefix_hit_rate"] > 0.2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://127.0.0.1:1", "--num-requests", "1"], "cannot list models"),
        (["--request-rate", "fast"], "is not a number"),
        (["--compare", "--strategies", "fastest"], "unknown strategy fastest"),
        (["--workload", "random", "--min-prompt-tokens", "9", "--max-prompt-tokens", "3"], "prompt lengths"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    out = bench(*args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_pd_runs_the_split_and_the_aggregated_stack_on_the_same_load(tmp_path: Path) -> None:
    """--pd 1:1: one stack of 1 prefill + 1 decode engine, one of 2 aggregated engines (issue 15)."""
    out = bench(
        "--simulate",
        "--pd", "1:1",
        "--pd-threshold", "400",  # short chats (<= 256 words + the template) stay whole
        "--workload", "long-prompt",
        "--long-fraction", "0.5",
        "--min-long-tokens", "800",
        "--max-long-tokens", "1200",
        "--output-tokens", "8",
        "--num-requests", "8",
        "--request-rate", "4",
        "--sim-time-scale", "0.5",
        "--sim-kv-blocks", "1024",
        "--no-progress",
        "--json", str(tmp_path / "r.json"),
        "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    records = {r["strategy"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert set(records) == {"aggregated-2", "pd-1:1"}
    assert all(r["errors"] == 0 and r["completed"] == 8 for r in records.values())
    assert records["aggregated-2"]["kv_transfers"] is None
    split = records["pd-1:1"]
    spec = WorkloadSpec(kind="long-prompt", long_prompt=LongPromptSpec(0.5, 800, 1200, output_tokens=8))
    longs = sum(1 for r in itertools.islice(generate(spec), 8) if r.group.startswith("long-"))
    assert 0 < longs < 8
    # every long prompt, and only those, handed off
    assert split["kv_transfers"] == longs and split["kv_transfer_fallbacks"] == 0
    assert split["kv_transfer_bytes"] > 0 and split["settings"]["pd"] == "1:1"
    assert "pd-1:1 vs aggregated-2 at 4 req/s: ITL p90" in out.stdout and "KV hand-offs" in out.stdout


def test_noisy_neighbor_preset_reports_every_tenant_of_every_run(tmp_path: Path) -> None:
    """--preset noisy-neighbor, shrunk to one engine and a second of arrivals per run: two stacks
    (flow control and none), seven runs, every tenant with its own key (none refused 401)."""
    out = bench(
        "--preset", "noisy-neighbor",
        "--engines", "1",
        "--duration", "1",
        "--min-long-tokens", "1500", "--max-long-tokens", "1500",
        "--min-prompt-tokens", "32", "--max-prompt-tokens", "32",
        "--output-tokens", "4",
        "--max-num-seqs", "4",
        "--sim-kv-blocks", "512",
        "--no-progress",
        "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "charts"),
        "--log-dir", str(tmp_path / "logs"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capacity (derived from the simulated engines' timing" in out.stdout
    assert "each tenant against itself alone" in out.stdout
    assert "critical TTFT p90 during the sheddable flood vs alone" in out.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    runs = {(r["run"], r["tenant"]): r for r in doc["rows"]}
    assert set(runs) == {
        ("alone", "B"), ("alone", "C"), ("alone", "critical"),
        ("flow control", "A"), ("flow control", "B"), ("flow control", "C"),
        ("priority, flow control", "flood"), ("priority, flow control", "critical"),
        ("no flow control", "A"), ("no flow control", "B"), ("no flow control", "C"),
        ("priority, no flow control", "flood"), ("priority, no flow control", "critical"),
    }  # fmt: skip
    for (_, tenant), r in runs.items():
        assert r["requests_sent"] > 0 and r["requests_other"] == 0, r  # every key accepted
        if tenant not in ("A", "flood"):
            assert r["requests_ok"] == r["requests_sent"] and r["ttft_p90_s"] > 0
    assert doc["capacity"]["long_req_s"] > 0 and len(doc["ratios"]) == 6
    assert doc["settings"]["flow_control_epp_args"] == []  # the defaults a user gets
    tenants = tmp_path / "logs" / "tenants.yaml"
    assert tenants.stat().st_mode & 0o077 == 0  # the keys are readable by their owner only
    assert (tmp_path / "logs" / "flow-control" / "epp.log").exists()
    assert (tmp_path / "logs" / "no-flow-control" / "epp.log").exists()
    for name in ("tenants_ttft_cdf.png", "tenants.png"):
        assert (tmp_path / "charts" / name).read_bytes()[:4] == b"\x89PNG"
    assert len(list(tmp_path.glob("requests-*.jsonl"))) == 13

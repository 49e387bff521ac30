"""The chart's dashboards and alerts are real: every Grafana panel query and every alert
expression of the chart (monitoring values on), run through a real Prometheus (Debian
`prometheus`) scraping a simulated stack — engines, the EPP, Envoy — that has served traffic,
must parse and return series.

Alert expressions are written to be empty while all is well (`... > threshold`); they are run
with `bool` comparisons, which keep every series and say 0 or 1, so an expression whose
metrics do not exist (a wrong name or label) still returns nothing and fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.testing import eventually
from kvgate.testing import processes as harness

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "bin" / "helm"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="Prometheus is not installed (Debian package `prometheus`; scripts/setup.sh)",
    ),
    pytest.mark.skipif(not HELM.exists(), reason=f"helm is not installed at {HELM} (scripts/setup.sh)"),
    pytest.mark.timeout(120),
]
EPP_JOB = "kvgate-epp"  # the chart's default monitoring.prometheusRule.eppJob


@dataclass
class Stack:
    prometheus: str  # base URL


def _render() -> tuple[list[dict[str, Any]], list[str]]:
    """The chart's PrometheusRule groups and every dashboard panel query."""
    out = subprocess.run(
        [str(HELM), "template", "t", str(ROOT / "charts" / "kvgate"),
         "--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.dashboards.enabled=true"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    groups: list[dict[str, Any]] = []
    queries: list[str] = []
    for doc in yaml.safe_load_all(out.stdout):
        if not doc:
            continue
        if doc["kind"] == "PrometheusRule":
            groups += doc["spec"]["groups"]
        elif doc["kind"] == "ConfigMap" and doc["metadata"].get("labels", {}).get("grafana_dashboard"):
            for text in doc["data"].values():
                for panel in json.loads(text)["panels"]:
                    queries += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    assert groups and queries, "monitoring values rendered no rules or dashboards"
    return groups, queries


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body.get('error')}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _as_bool(expr: str) -> str:
    """`a > 0.05` -> `a > bool 0.05`, outside label matchers only."""
    out, depth = [], 0
    for part in re.split(r"(\{|\}|(?:>=|<=|==|!=|>|<)\s*(?=-?[\d.]))", expr):
        if part == "{":
            depth += 1
        elif part == "}":
            depth -= 1
        elif depth == 0 and re.fullmatch(r"(?:>=|<=|==|!=|>|<)\s*", part or "x"):
            part = f"{part.strip()} bool "
        out.append(part)
    return "".join(out)


def test_bool_rewrite() -> None:
    assert _as_bool('up{job="x"} == 0') == 'up{job="x"} == bool 0'
    assert _as_bool('a{b!="1"} / 5 >= 1 or c > 0.8') == 'a{b!="1"} / 5 >= bool 1 or c > bool 0.8'


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("monitoring")
    groups, _ = _render()
    rules = tmp / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run([str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr  # every rule parses
    with harness.gateway_stack(tmp) as (engines, epp, envoy):
        config = {
            "global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "engines", "static_configs": [{"targets": [e.address for e in engines]}]},
                {"job_name": EPP_JOB, "static_configs": [{"targets": [f"127.0.0.1:{epp.metrics_port}"]}]},
            ],
        }
        assert PROMETHEUS is not None
        prometheus = harness.start_prometheus(tmp, PROMETHEUS, config)
        try:
            base = prometheus.wait_ready().url
            model = httpx.get(f"{envoy.url}/v1/models", timeout=10).json()["data"][0]["id"]
            # the counters start before the traffic: rate() then sees it
            eventually(
                lambda: _query(base, "vllm:request_success_total"), 30, "engines scraped", interval=0.2
            )
            for i in range(12):
                r = httpx.post(
                    f"{envoy.url}/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": [{"role": "user", "content": f"hi {i % 3}"}],
                        "max_tokens": 8,
                    },
                    timeout=30,
                )
                assert r.status_code == 200, r.text
            bad = httpx.post(
                f"{envoy.url}/v1/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
                timeout=30,
            )
            assert bad.status_code == 400  # answered (and counted) by the EPP
            unknown = httpx.post(
                f"{envoy.url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=30
            )
            assert unknown.status_code == 404  # answered (and counted) by an engine
            eventually(
                lambda: (
                    _query(base, "sum(vllm:request_success_total) >= 12")
                    and _query(base, "inference_objective_request_error_total")
                    and _query(base, 'http_requests_total{status="4xx"}')
                ),
                30,
                "the traffic scraped",
                interval=0.2,
            )
            yield Stack(base)
        finally:
            harness.stop_all(prometheus.proc)


def _queries() -> list[str]:
    if not HELM.exists():  # collected, then skipped by the module's mark
        return []
    return sorted(set(_render()[1]))


def _alerts() -> list[tuple[str, str]]:
    if not HELM.exists():
        return []
    groups, _ = _render()
    return [(r["alert"], r["expr"]) for g in groups for r in g["rules"]]


@pytest.mark.parametrize("expr", _queries())
def test_every_dashboard_query_returns_series(stack: Stack, expr: str) -> None:
    # Grafana's interval variables, as Grafana fills them for a short range
    concrete = expr.replace("$__rate_interval", "30s").replace("$__interval", "15s")
    # a dashboard variable ($pool, $namespace...) would need a value here: fail loudly, not as a parse error
    assert "$" not in concrete, f"unsubstituted dashboard variable in {expr!r}"
    assert _query(stack.prometheus, concrete), f"no series for panel query {expr!r}"


@pytest.mark.parametrize(("alert", "expr"), _alerts())
def test_every_alert_expression_has_its_metrics(stack: Stack, alert: str, expr: str) -> None:
    assert _query(stack.prometheus, _as_bool(expr)), f"{alert}: no series for {_as_bool(expr)!r}"

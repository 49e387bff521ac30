"""Writes the chart's Grafana dashboards (charts/kvgate/dashboards/*.json) from one table of panels.

Run `python scripts/gen_dashboards.py` after editing a panel; tests/operator/test_schemas_and_manifests.py
fails while a committed dashboard differs from this output, and tests/operator/test_monitoring.py runs
every panel query against a live simulated stack in a real Prometheus. Queries use Grafana's
`$__rate_interval`; the datasource is a dashboard variable, so the JSON imports anywhere.
Usage: .venv/bin/python scripts/gen_dashboards.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "charts" / "kvgate" / "dashboards"
R = "$__rate_interval"
GENERATION = "/v1/completions|/v1/chat/completions"  # the handlers that generate


def _q(metric: str, by: str = "", q: float = 0.9) -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{R}])))"


def _pcts(metric: str) -> list[tuple[str, str]]:
    return [(_q(metric, q=q), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, [(expr, legend)])
POOL = [
    (
        "Requests/s by finish reason",
        "reqps",
        [(f"sum by (finished_reason) (rate(vllm:request_success_total[{R}]))", "{{finished_reason}}")],
    ),
    ("Time to first token", "s", _pcts("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", _pcts("vllm:inter_token_latency_seconds")),
    ("End-to-end latency", "s", _pcts("vllm:e2e_request_latency_seconds")),
    (
        "Queued and running requests",
        "short",
        [
            ("sum(vllm:num_requests_waiting)", "waiting"),
            ("sum(vllm:num_requests_running)", "running"),
            ("inference_pool_average_queue_size", "pool mean queue {{name}}"),
        ],
    ),
    (
        "KV-cache use",
        "percentunit",
        [
            ("inference_pool_average_kv_cache_utilization", "pool mean {{name}}"),
            ("max(vllm:kv_cache_usage_perc)", "fullest engine"),
        ],
    ),
    (
        "Prefix-cache hit rate: pool vs engines",
        "percentunit",
        [
            (
                f"sum(rate(vllm:prefix_cache_hits_total[{R}])) / sum(rate(vllm:prefix_cache_queries_total[{R}]))",
                "pool",
            ),
            (
                f"sum by (instance) (rate(vllm:prefix_cache_hits_total[{R}])) "
                f"/ sum by (instance) (rate(vllm:prefix_cache_queries_total[{R}]))",
                "{{instance}}",
            ),
        ],
    ),
    (
        "Picks/s by model (EPP)",
        "reqps",
        [(f"sum by (model_name) (rate(inference_objective_request_total[{R}]))", "{{model_name}}")],
    ),
    (
        "Failed requests/s by status (429: shed)",
        "reqps",
        [(f"sum by (error_code) (rate(inference_objective_request_error_total[{R}]))", "{{error_code}}")],
    ),
    (
        # counted by the engines (vLLM's http_requests_total): the EPP stays out of the response path
        "Engine error answers/s (4xx, 5xx)",
        "reqps",
        [
            (
                f'sum by (instance, status) (rate(http_requests_total{{handler=~"{GENERATION}", status=~"4xx|5xx"}}[{R}]))',
                "{{instance}} {{status}}",
            )
        ],
    ),
    ("Ready endpoints", "short", [("inference_pool_ready_pods", "{{name}}")]),
]

ENGINE = [
    (
        "Generated tokens/s",
        "short",
        [(f"sum by (instance) (rate(vllm:generation_tokens_total[{R}]))", "{{instance}}")],
    ),
    (
        "Prompt tokens/s by source",
        "short",
        [
            (
                f"sum by (instance, source) (rate(vllm:prompt_tokens_by_source_total[{R}]))",
                "{{instance}} {{source}}",
            )
        ],
    ),
    ("Running", "short", [("vllm:num_requests_running", "{{instance}}")]),
    ("Waiting", "short", [("vllm:num_requests_waiting", "{{instance}}")]),
    ("KV-cache use", "percentunit", [("vllm:kv_cache_usage_perc", "{{instance}}")]),
    ("TTFT p90", "s", [(_q("vllm:time_to_first_token_seconds", "instance"), "{{instance}}")]),
    ("Queue time p90", "s", [(_q("vllm:request_queue_time_seconds", "instance"), "{{instance}}")]),
    ("Prefill time p90", "s", [(_q("vllm:request_prefill_time_seconds", "instance"), "{{instance}}")]),
    ("Decode time p90", "s", [(_q("vllm:request_decode_time_seconds", "instance"), "{{instance}}")]),
    (
        "Time per output token p90",
        "s",
        [(_q("vllm:request_time_per_output_token_seconds", "instance"), "{{instance}}")],
    ),
    ("Tokens per step p50", "short", [(_q("vllm:iteration_tokens_total", "instance", 0.5), "{{instance}}")]),
    (
        "Preemptions/s",
        "short",
        [(f"sum by (instance) (rate(vllm:num_preemptions_total[{R}]))", "{{instance}}")],
    ),
    ("Prefill tokens pending", "short", [("kvgate:prefill_tokens_pending", "{{instance}}")]),
    ("Draining", "short", [("kvgate:draining", "{{instance}}")]),
]

EPP = [
    ("Pick latency p99 by plugin", "s",
     [(_q("inference_extension_plugin_duration_seconds", "plugin_name", 0.99), "{{plugin_name}}")]),
    ("Scheduler latency", "s", _pcts("inference_extension_scheduler_e2e_duration_seconds")),
    ("Request duration seen by the EPP p90", "s",
     [(_q("inference_objective_request_duration_seconds", "model_name"), "{{model_name}}")]),
    ("Requests in flight", "short", [("sum(inference_objective_running_requests)", "in flight")]),
    ("Scrape staleness (age of each endpoint's metrics)", "s",
     [("kvgate_epp_endpoint_metrics_age_seconds", "{{endpoint}}")]),
    ("KV events live", "short", [("kvgate_epp_kv_events_live", "{{endpoint}}")]),
    ("Prefix index blocks", "short", [("kvgate_epp_prefix_index_blocks", "{{endpoint}}")]),
    ("Queue per endpoint", "short", [("inference_pool_per_pod_queue_size", "{{model_server_pod}}")]),
    # flow control (kvgate.epp.flow_control): held requests per flow (tenant, priority)
    ("Flow-control queue per flow", "short",
     [("sum by (fairness_id, priority) (inference_extension_flow_control_queue_size)",
       "{{fairness_id}} p{{priority}}")]),
    ("Flow-control queue time p90 per flow", "s",
     [(_q("inference_extension_flow_control_request_queue_duration_seconds", "fairness_id, priority"),
       "{{fairness_id}} p{{priority}}")]),
    ("Flow-control rejections/s by reason", "reqps",
     [(f"sum by (reason) (rate(kvgate_epp_flow_control_rejections_total[{R}]))", "{{reason}}")]),
]  # fmt: skip


def dashboard(uid: str, title: str, panels: list[tuple[str, str, list[tuple[str, str]]]]) -> dict:
    out = []
    for i, (panel_title, unit, targets) in enumerate(panels):
        out.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": uid,
        "title": title,
        "tags": ["kvgate"],
        "schemaVersion": 39,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}
            ]
        },
        "panels": out,
    }


DASHBOARDS = {
    "kvgate-pool-overview": ("kvgate / pool overview", POOL),
    "kvgate-engine-detail": ("kvgate / engines", ENGINE),
    "kvgate-epp": ("kvgate / endpoint picker", EPP),
}


def rendered() -> dict[str, str]:
    """Each dashboard's file name in OUT and its exact text."""
    return {
        f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=1) + "\n"
        for uid, (title, panels) in DASHBOARDS.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a file differs instead of writing")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    expected = rendered()
    stale: list[str] = []
    for name, text in expected.items():
        path = OUT / name
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(OUT.parents[2])}")
    if stale:
        print("stale dashboards (run scripts/gen_dashboards.py): " + ", ".join(stale), file=sys.stderr)
    # the chart ships every dashboards/*.json, so a file no table here makes was written by hand
    unknown = sorted(p.name for p in OUT.glob("*.json") if p.name not in expected)
    if unknown:
        print(
            "not written by scripts/gen_dashboards.py (remove them): " + ", ".join(unknown), file=sys.stderr
        )
    return 1 if stale or unknown else 0


if __name__ == "__main__":
    sys.exit(main())

"""Pool signals from a real Prometheus (Debian `prometheus`) scraping simulated engines and the EPP.

Two `kvgate engine serve --simulate` processes and one `kvgate epp serve` over them run on
loopback; Prometheus scrapes all three every 0.5 s. The operator (real kopf, against kmock)
runs with --prometheus-url and must put the pool's live queue and saturation into status and
say whether the autoscaler's query returns data.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.operator.resources import MODEL_DEPLOYMENTS, SCALED_OBJECTS
from kvgate.operator.signals import SignalReader
from kvgate.testing import eventually
from kvgate.testing import processes as harness

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Prometheus is not installed (Debian package `prometheus`; scripts/setup.sh)"
)
NS = "models"
POOL = "smol"
SERVED = "smollm2"
# One running sequence at a time, so a burst of requests queues up measurably.
ENGINE_ARGS = (
    "--served-model-name",
    SERVED,
    "--max-num-seqs",
    "1",
    "--sim-itl",
    "0.05",
    "--shutdown-timeout",
    "1",
)


@dataclass
class Stack:
    prometheus_url: str
    engines: list[str]  # host:port


def _serves(url: str, needle: str = "") -> bool:
    status, body = harness.http_get(url, timeout=1)
    return status == 200 and needle in body


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prom")
    procs: list[harness.Process] = []
    try:
        engines = [harness.start_engine(tmp, *ENGINE_ARGS) for _ in range(2)]
        procs += [e.proc for e in engines]
        epp = harness.start_epp(tmp, engines, kv_events=False)
        procs.append(epp.proc)
        config = {
            "global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "engines", "static_configs": [{"targets": [e.address for e in engines]}]},
                {
                    "job_name": "epp",
                    "static_configs": [{"targets": [f"127.0.0.1:{epp.metrics_port}"]}],
                    # A local EPP names its pool "local"; in a cluster it is the pool's name.
                    "metric_relabel_configs": [
                        {
                            "source_labels": ["name"],
                            "regex": "local",
                            "target_label": "name",
                            "replacement": POOL,
                        }
                    ],
                },
            ],
        }
        assert PROMETHEUS is not None
        prometheus = harness.start_prometheus(tmp, PROMETHEUS, config)
        procs.append(prometheus.proc)
        st = Stack(prometheus.url, [e.address for e in engines])
        for engine in engines:
            engine.wait_ready()
        metrics = f"http://127.0.0.1:{epp.metrics_port}/metrics"
        eventually(
            lambda: _serves(metrics, "inference_pool_average_queue_size"), 60, "EPP metrics", watch=[epp.proc]
        )
        prometheus.wait_ready()
        # Both sources scraped at least once.
        for query in (f'inference_pool_average_queue_size{{name="{POOL}"}}', "vllm:num_requests_waiting"):
            url = f"{st.prometheus_url}/api/v1/query?query={urllib.request.quote(query)}"
            eventually(lambda url=url: _serves(url, '"value"'), 30, f"Prometheus has {query}", interval=0.2)
        yield st
    finally:
        harness.stop_all(*procs)


async def test_signal_reader_reads_the_pool_from_the_epp(stack: Stack) -> None:
    reader = SignalReader(stack.prometheus_url)
    signals = await reader.read(POOL, SERVED)
    assert signals.source == "epp"
    assert signals.queue_size == 0.0 and signals.kv_cache_utilization == 0.0 and signals.saturation == 0.0
    # A pool the EPP does not report: the engines' own gauges for the served model stand in.
    fallback = await reader.read("other-pool", SERVED)
    assert fallback.source == "engines" and fallback.queue_size == 0.0
    nothing = await reader.read("other-pool", "no-such-model")
    assert nothing.source == "none" and nothing.saturation is None
    for metric in ("queue-size", "kv-cache-utilization", "saturation"):
        assert (await reader.check(ch.autoscaler_query(POOL, metric))).has_data, metric
    assert not (await reader.check(ch.autoscaler_query("other-pool", "saturation"))).has_data
    down = await SignalReader(f"http://127.0.0.1:{harness.free_port()}").check("up")
    assert not down.has_data and down.error


@pytest.fixture
def operator_config(stack: Stack) -> OperatorConfig:
    return OperatorConfig(
        namespaces=(NS,),
        resync_seconds=0.4,
        standalone=True,
        scanning=False,
        prometheus_url=stack.prometheus_url,
    )


def _md(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid},
        "spec": {
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": SERVED},
            "autoscaling": {"backend": "keda", "metric": "saturation", "target": "0.8"},
        },
    }


async def test_operator_puts_live_signals_into_status(stack: Stack, cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, _md(POOL, "uid-smol"))
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, _md("ghost", "uid-ghost"))

    def status(name: str) -> dict[str, Any]:
        return cluster.objects(MODEL_DEPLOYMENTS)[name].get("status") or {}

    def metrics_condition(name: str) -> dict[str, Any] | None:
        return next((c for c in status(name).get("conditions", []) if c["type"] == "Metrics"), None)

    cond = await cluster.eventually(lambda: metrics_condition(POOL), within=20, what="Metrics condition")
    assert cond["status"] == "True" and cond["reason"] == "QueryHasData"
    st = status(POOL)
    assert st["signals"]["queueSize"] == "0" and st["signals"]["saturation"] == "0"
    assert st["autoscaler"] == {
        "kind": "ScaledObject",
        "query": ch.autoscaler_query(POOL, "saturation"),
        "hasData": True,
    }
    # The ScaledObject queries exactly what the operator checked.
    so = cluster.objects(SCALED_OBJECTS)[POOL]
    assert so["spec"]["triggers"][0]["metadata"]["query"] == st["autoscaler"]["query"]

    ghost = await cluster.eventually(
        lambda: metrics_condition("ghost"), within=20, what="ghost Metrics condition"
    )
    assert ghost["status"] == "False" and ghost["reason"] == "NoData"
    assert "ghost" in ghost["message"]
    assert "spec.networkPolicy.metricsFrom" in ghost["message"]  # policies are on by default
    # No EPP series for "ghost", but its engines serve the same model: the status still shows them.
    assert status("ghost")["signals"]["queueSize"] == "0"


def _burst(engine: str, n: int, max_tokens: int) -> None:
    """n concurrent completions against one engine, fire and forget (threads end with it)."""
    body = json.dumps(
        {"model": SERVED, "prompt": "hello " * 20, "max_tokens": max_tokens, "ignore_eos": True}
    )

    def send() -> None:
        req = urllib.request.Request(
            f"http://{engine}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            pass  # the engine stops at teardown

    for _ in range(n):
        threading.Thread(target=send, daemon=True).start()


async def test_queue_under_load_reaches_status(stack: Stack, cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, _md(POOL, "uid-smol"))
    for engine in stack.engines:
        _burst(engine, n=6, max_tokens=100)  # ~5 s per request: 5 wait behind 1 on each engine

    def signals() -> dict[str, Any]:
        return (cluster.objects(MODEL_DEPLOYMENTS)[POOL].get("status") or {}).get("signals") or {}

    live = await cluster.eventually(
        lambda: float(signals().get("queueSize", "0")) >= 1 and signals(), within=20, what="a queue in status"
    )
    queue = float(live["queueSize"])
    kv = float(live["kvCacheUtilization"])
    # docs/architecture.md, "Saturation": saturation = max(queue / 5, kv / 0.8), here from the
    # EPP's pool averages.
    assert float(live["saturation"]) == pytest.approx(max(queue / 5, kv / 0.8), abs=0.002)
    reader = SignalReader(stack.prometheus_url)
    direct = await reader.read(POOL, SERVED)
    assert direct.source == "epp" and direct.queue_size is not None and direct.queue_size >= 1

"""The chart's gateway Envoy is rendered from the same builder as the local one (one generator),
stays fresh, validates with the real Envoy binary, and keeps the security fixes in a real run:
a client-set x-gateway-destination-endpoint never chooses an engine, also with FailOpen and the
EPP down."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate.testing import processes as harness

ROOT = Path(__file__).resolve().parents[1]
HELM = ROOT / ".tools" / "bin" / "helm"
pytestmark = pytest.mark.timeout(120)


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_envoy_config", ROOT / "scripts" / "gen_envoy_config.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_chart(*sets: str) -> dict:
    out = subprocess.run(
        [str(HELM), "template", "t", str(ROOT / "charts" / "kvgate"), "--set", "envoyGateway.enabled=true",
         "--set", "envoyGateway.pool=p", *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    for doc in yaml.safe_load_all(out.stdout):
        if doc and doc.get("kind") == "ConfigMap" and "envoy.yaml" in doc.get("data", {}):
            return yaml.safe_load(doc["data"]["envoy.yaml"])
    raise AssertionError("no gateway ConfigMap rendered")


def _docs(*sets: str) -> list[dict]:
    out = subprocess.run(
        [str(HELM), "template", "t", str(ROOT / "charts" / "kvgate"), "--namespace", "ns", "--set",
         "envoyGateway.enabled=true", "--set", "envoyGateway.pool=p", *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _epp_cluster(docs: list[dict]) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})]
    clusters = yaml.safe_load(cm["data"]["envoy.yaml"])["static_resources"]["clusters"]
    return next(c for c in clusters if c["name"] == "epp")


def test_chart_gateway_has_every_epp_replica_as_a_host() -> None:
    """By default the gateway resolves a headless Service of the pool's EPP pods: one Envoy host
    per ready replica, each health-checked (not one ClusterIP, which pins every pick to one pod)."""
    docs = _docs()
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "p-epp-replicas"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    # the operator's EPP pods (operator/children/epp.py) on their named gRPC port
    assert svc["spec"]["selector"] == {"kvgate.dev/model-deployment": "p", "kvgate.dev/role": "epp"}
    assert svc["spec"]["ports"][0]["targetPort"] == "grpc"
    epp = _epp_cluster(docs)
    address = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["address"] == "p-epp-replicas.ns.svc"
    assert epp["type"] == "STRICT_DNS" and epp["dns_refresh_rate"] == "1s"
    assert epp["health_checks"] and epp["outlier_detection"]
    # a Service of the user's own: used as given, no headless Service of ours
    docs = _docs("envoyGateway.eppService=mine")
    assert not [d for d in docs if d["metadata"]["name"] == "p-epp-replicas"]
    address = _epp_cluster(docs)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["address"] == "mine.ns.svc"


def test_chart_gateway_sends_picks_to_the_pools_engines_and_retries_elsewhere() -> None:
    """The picked route goes to a cluster of the pool's engines (a headless Service of the engine
    pods, one host per address) with Envoy's override-host policy, not to an ORIGINAL_DST
    cluster: a request that fails before its first byte is retried on another engine instead of
    the same dead pod address."""
    docs = _docs()
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "p-engines"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    # the operator's engine pods (operator/children/common.engine_selector) on their named port
    assert svc["spec"]["selector"] == {"kvgate.dev/model-deployment": "p", "kvgate.dev/role": "engine"}
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})]
    cfg = yaml.safe_load(cm["data"]["envoy.yaml"])
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "pool")
    assert pool["type"] == "STRICT_DNS" and pool["dns_refresh_rate"] == "1s"
    address = pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "p-engines.ns.svc", "port_value": 8000}
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "name" in r}
    picked = routes["picked"]
    assert picked["route"]["cluster"] == "pool"
    retry = picked["route"]["retry_policy"]
    assert retry["num_retries"] == 2 and "connect-failure" in retry["retry_on"]
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert picked["request_body_buffer_limit"] == "8388608"  # the body is kept for a retry
    assert routes["unpicked"]["route"]["cluster"] == "pool"
    # engines named by the user: no Service of ours, their address and port
    docs = _docs("envoyGateway.engineAddress=engines.example", "envoyGateway.enginePort=9000")
    assert not [d for d in docs if d["metadata"]["name"] == "p-engines"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})]
    pool = next(
        c
        for c in yaml.safe_load(cm["data"]["envoy.yaml"])["static_resources"]["clusters"]
        if c["name"] == "pool"
    )
    address = pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "engines.example", "port_value": 9000}


def test_chart_gateway_config_is_generated_and_fresh() -> None:
    gen = _generator()
    assert gen.TARGET.read_text() == gen.rendered(), (
        "charts/kvgate/files/envoy.yaml is stale: run scripts/gen_envoy_config.py"
    )


@pytest.mark.parametrize(
    "sets",
    [
        ("envoyGateway.failureMode=FailOpen", "envoyGateway.eppTLS=false"),
        ("envoyGateway.failureMode=FailClose", "envoyGateway.maxRequestBodyBytes=1048576"),
    ],
)
def test_chart_gateway_validates_and_is_hardened(sets: tuple[str, ...], tmp_path: Path) -> None:
    cfg = render_chart(*sets)
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(cfg))
    result = subprocess.run(
        [harness.envoy_bin(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    rc = hcm["route_config"]
    assert rc["internal_only_headers"] == ["x-gateway-destination-endpoint", "x-prefiller-host-port"]
    assert "x-kvgate-inject-failure" in rc["request_headers_to_remove"]
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    fail_open = hcm["http_filters"][0]["typed_config"].get("failure_mode_allow", False)
    assert fail_open is ("envoyGateway.failureMode=FailOpen" in sets)


def test_chart_gateway_ignores_a_forged_destination(tmp_path: Path) -> None:
    engine = harness.start_engine(tmp_path)
    procs = [engine.proc]
    try:
        engine.wait_ready()
        epp = harness.start_epp(tmp_path, [engine])
        procs.append(epp.proc)
        port, admin = harness.free_ports(2)
        cfg = render_chart(
            "envoyGateway.failureMode=FailOpen",
            "envoyGateway.eppTLS=false",
            "envoyGateway.eppAddress=127.0.0.1",
            f"envoyGateway.eppPort={epp.grpc_port}",
            f"envoyGateway.eppHealthPort={epp.health_port}",
            f"envoyGateway.port={port}",
            "envoyGateway.engineAddress=127.0.0.1",
            f"envoyGateway.enginePort={engine.port}",
        )
        cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = "127.0.0.1"
        cfg["admin"]["address"]["socket_address"]["port_value"] = admin
        path = tmp_path / "chart-envoy.json"
        path.write_text(json.dumps(cfg))
        argv = harness.envoy_argv(path)
        envoy = harness.Envoy(
            harness.Process("chart-envoy", argv, tmp_path / "chart-envoy.log").start(), port, admin
        )
        procs.append(envoy.proc)
        harness.wait_gateway(epp, envoy)
        # a listener the client would like to reach instead: it must never see a connection
        trap = socket.create_server(("127.0.0.1", 0))
        trap.settimeout(0)
        forged = trap.getsockname()[1]
        body = {"model": "default", "prompt": "forged", "max_tokens": 2}
        headers = {"x-gateway-destination-endpoint": f"127.0.0.1:{forged}"}
        resp = httpx.post(f"{envoy.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert resp.status_code == 200, resp.text  # the EPP's pick, not the client's
        assert httpx.get(f"{envoy.url}/metrics", timeout=10).status_code == 404
        epp.proc.kill()
        envoy.wait_epp_healthy(False)
        resp = httpx.post(f"{envoy.url}/v1/completions", json=body, headers=headers, timeout=10)
        # FailOpen with the EPP down: either let through to the pool's engines (round robin over
        # them, as the pool cluster falls back to) or refused as JSON; never the forged port
        if resp.status_code == 200:
            assert resp.json()["choices"][0]["text"]
        else:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["type"] == "service_unavailable"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody connected to the forged destination
        trap.close()
    finally:
        harness.stop_all(*procs)

"""The chart's gateway Envoy is rendered from the same builder as the local one (one generator),
stays fresh, validates with the real Envoy binary, and keeps the security fixes in a real run:
a client-set x-gateway-destination-endpoint never chooses an engine, also with FailOpen and the
EPP down."""

from __future__ import annotations

import importlib.util
import json
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
    assert rc["internal_only_headers"] == ["x-gateway-destination-endpoint"]
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
            f"envoyGateway.port={port}",
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
        epp.wait_ready()
        envoy.wait_ready()
        envoy.wait_epp_healthy()
        # a listener the client would like to reach instead: it must never see a connection
        forged = harness.free_ports(1)[0]
        body = {"model": "default", "prompt": "forged", "max_tokens": 2}
        headers = {"x-gateway-destination-endpoint": f"127.0.0.1:{forged}"}
        resp = httpx.post(f"{envoy.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert resp.status_code == 200, resp.text  # the EPP's pick, not the client's
        assert httpx.get(f"{envoy.url}/metrics", timeout=10).status_code == 404
        epp.proc.kill()
        envoy.wait_epp_healthy(False)
        resp = httpx.post(f"{envoy.url}/v1/completions", json=body, headers=headers, timeout=10)
        # FailOpen with the EPP down and no destination: refused as JSON, never sent to the forged port
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "service_unavailable"
    finally:
        harness.stop_all(*procs)

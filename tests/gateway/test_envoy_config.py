"""The Envoy bootstrap is built from typed protos and accepted by the real Envoy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.gateway.envoy_config import GatewaySpec, PoolSpec, build_bootstrap, main

ENVOY = str(Path(sys.executable).parent / "envoy")


def validate(config: dict, tmp_path: Path) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    out = subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def one(*epps: str, **settings) -> dict:
    """The bootstrap of a one-pool gateway on port 10000 (EPP default: 127.0.0.1:9002)."""
    return build_bootstrap(
        GatewaySpec.one_pool(list(epps) or ["127.0.0.1:9002"], listen_port=10000, **settings)
    )


def _filter(config: dict) -> dict:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


@pytest.mark.timeout(120)
def test_every_variant_validates(tmp_path) -> None:
    variants = [
        one(failure_mode="FailClose"),
        one(
            failure_mode="FailOpen",
            admin_port=9901,
            direct_upstream="127.0.0.1:8000",
            fallback_endpoints=["127.0.0.1:8000", "127.0.0.1:8001"],
            epp_tls=True,
        ),
        one(
            "epp.models.svc:9002",
            failure_mode="FailOpen",
            epp_health_check=False,
            expose_upstream_header=False,
        ),
        one(
            "127.0.0.1:9002",
            "127.0.0.1:9012",
            pool_endpoints=["127.0.0.1:8000", "127.0.0.1:8001"],
            response_phase=True,
            expose_upstream_header=True,
            expose_internal_routes=True,
        ),
        build_bootstrap(
            GatewaySpec(
                pools=[
                    PoolSpec(
                        "alpha", ["127.0.0.1:9002", "127.0.0.1:9012"], ["127.0.0.1:8000"], ["127.0.0.1:8000"]
                    ),
                    PoolSpec("beta", ["epp-beta.svc:9002"], ["beta-engines:8000"]),
                ],
                listen_port=10000,
                failure_mode="FailOpen",
                model_router_addresses=["127.0.0.1:9004"],
            )
        ),
    ]
    for v in variants:
        validate(v, tmp_path)


def test_several_pools_behind_one_model_router() -> None:
    config = build_bootstrap(
        GatewaySpec(
            pools=[
                PoolSpec("alpha", ["127.0.0.1:9002"], ["127.0.0.1:8000", "127.0.0.1:8001"]),
                PoolSpec("beta", ["127.0.0.1:9012"], ["127.0.0.1:8002"]),
            ],
            listen_port=10000,
            model_router_addresses=["127.0.0.1:9004"],
        )
    )
    hcm = _filter(config)
    # the model router runs first (it names the pool), then the EPP, then the router
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["kvgate.model_router", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    router_mode = hcm["http_filters"][0]["typed_config"]["processing_mode"]
    assert router_mode["request_body_mode"] == "FULL_DUPLEX_STREAMED" and not hcm["http_filters"][0][
        "typed_config"
    ].get("failure_mode_allow")
    assert "x-kvgate-pool" in hcm["route_config"]["internal_only_headers"]
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    for pool in ("alpha", "beta"):
        for kind in ("picked", "unpicked"):
            route = routes[f"{kind} {pool}"]
            match = [h for h in route["match"]["headers"] if h["name"] == "x-kvgate-pool"]
            assert match == [{"name": "x-kvgate-pool", "string_match": {"exact": pool}}]
            # the pool's EPP stream goes to its own EPP replicas
            override = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
            assert override["grpc_service"]["envoy_grpc"]["cluster_name"] == f"epp-{pool}"
        assert routes[f"picked {pool}"]["route"]["cluster"] == f"pool-{pool}"
    # before the router names a pool, only the EPP is off (the router must run on this route)
    no_pool = routes["no_pool"]["typed_per_filter_config"]
    assert set(no_pool) == {"envoy.filters.http.ext_proc"}
    # Envoy's own answers (413, internal paths) never ask either processor
    assert set(routes["body_too_large"]["typed_per_filter_config"]) == {
        "envoy.filters.http.ext_proc",
        "kvgate.model_router",
    }
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert {"epp-alpha", "epp-beta", "pool-alpha", "pool-beta", "model_router"} <= clusters
    with pytest.raises(ValueError, match="model router"):
        build_bootstrap(GatewaySpec([PoolSpec("a", ["127.0.0.1:1"])], listen_port=10000))
    with pytest.raises(ValueError, match="model router"):
        build_bootstrap(GatewaySpec([PoolSpec(None, ["127.0.0.1:1"])] * 2, listen_port=10000))
    with pytest.raises(ValueError, match="unique"):
        build_bootstrap(
            GatewaySpec(
                [PoolSpec("a", ["127.0.0.1:1"])] * 2,
                listen_port=10000,
                model_router_addresses=["127.0.0.1:2"],
            )
        )
    with pytest.raises(ValueError, match="unique"):  # behind the router, every pool is named
        build_bootstrap(
            GatewaySpec(
                [PoolSpec(None, ["127.0.0.1:1"])], listen_port=10000, model_router_addresses=["127.0.0.1:2"]
            )
        )


def test_gie_settings() -> None:
    cfg = one(failure_mode="FailOpen", direct_upstream="127.0.0.1:8000")
    hcm = _filter(cfg)
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    # the EPP stays out of the response path unless asked (docs/architecture.md, "The request
    # path", step 6)
    assert ext["processing_mode"] == {  # response_body_mode NONE is proto3's default: omitted
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SKIP",
    }
    full = _filter(one(response_phase=True))
    assert full["http_filters"][0]["typed_config"]["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    od = clusters["original_destination"]
    assert od["type"] == "ORIGINAL_DST" and od["lb_policy"] == "CLUSTER_PROVIDED"
    assert od["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    epp = clusters["epp"]
    assert "http2_protocol_options" in json.dumps(epp["typed_extension_protocol_options"])
    assert (
        epp["health_checks"][0]["grpc_health_check"]["service_name"]
        == "envoy.service.ext_proc.v3.ExternalProcessor"
    )
    direct = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert direct["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    closed = _filter(one(failure_mode="FailClose"))
    assert closed["http_filters"][0]["typed_config"].get("failure_mode_allow", False) is False


def test_every_timeout_is_bounded() -> None:
    hcm = _filter(one())
    for key in ("request_headers_timeout", "request_timeout", "stream_idle_timeout"):
        assert hcm[key] not in ("0s", None), key
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if "route" in route:
            assert route["route"]["timeout"] != "0s"
            assert route["route"]["idle_timeout"] != "0s"
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["message_timeout"] == "10s"
    assert hcm["route_config"]["request_headers_to_remove"] == ["x-kvgate-inject-failure"]
    assert "x-gateway-destination-endpoint" in hcm["route_config"]["internal_only_headers"]


def test_several_epp_replicas_are_health_checked_hosts() -> None:
    cfg = one("127.0.0.1:9002", "127.0.0.1:9012")
    epp = {c["name"]: c for c in cfg["static_resources"]["clusters"]}["epp"]
    hosts = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == [9002, 9012]
    assert epp["health_checks"] and epp["outlier_detection"]


@pytest.mark.parametrize("tls", [False, True])
def test_epp_replicas_are_health_checked_on_their_health_ports_in_plaintext(tls: bool) -> None:
    cfg = one("127.0.0.1:9002", "127.0.0.1:9012", epp_health_ports=[9003, 9013], epp_tls=tls)
    epp = {c["name"]: c for c in cfg["static_resources"]["clusters"]}["epp"]
    endpoints = [e["endpoint"] for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert [e["address"]["socket_address"]["port_value"] for e in endpoints] == [9002, 9012]
    assert [e["health_check_config"]["port_value"] for e in endpoints] == [9003, 9013]
    (check,) = epp["health_checks"]
    (match,) = epp["transport_socket_matches"]
    assert check["transport_socket_match_criteria"] == match["match"]
    assert match["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"
    assert ("transport_socket" in epp) == tls  # the ext_proc streams keep their TLS
    # an overloaded EPP's streams wait, they do not overflow Envoy's default 1,024
    (limits,) = epp["circuit_breakers"]["thresholds"]
    assert limits["max_requests"] == limits["max_pending_requests"] == 65536


def test_a_health_port_per_epp_address() -> None:
    with pytest.raises(ValueError, match="one port"):
        one("127.0.0.1:9002", epp_health_ports=[1, 2])
    with pytest.raises(ValueError, match="one port"):
        one(epp_health_ports=[0])


def test_bad_failure_mode() -> None:
    with pytest.raises(ValueError, match="FailOpen or FailClose"):
        one(failure_mode="Sometimes")


def test_module_prints_yaml(capsys) -> None:
    assert main(["--listen-port", "8081", "--epp", "127.0.0.1:9002", "--failure-mode", "FailOpen"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 8081
    assert main(["--epp", "nonsense"]) == 2

"""The node agent's pure parts; tests/cluster/test_workloads.py runs it against the API server."""

from __future__ import annotations

import pytest

from kvgate.testing.node_agent import _loopback_url, component_of, foreign_of, stand_in_of


@pytest.mark.parametrize(
    ("image", "component"),
    [("ghcr.io/kvgate/engine:0.1.0", "engine"), ("localhost/kvgate-epp:dev", "epp"),
     ("ghcr.io/kvgate/operator@sha256:abc", "operator"), ("docker.io/envoyproxy/envoy:v1.40.0", None),
     ("engine-tools/other:1", None), ("", None)],
)  # fmt: skip
def test_only_kvgate_images_run_as_processes(image: str, component: str | None) -> None:
    assert component_of(image) == component


@pytest.mark.parametrize(
    ("image", "binary"),
    [("gcr.io/k8s-staging-gateway-api/echo-basic:v20251106-v1.3.0-263-g47c3435c", "echo-basic"),
     ("docker.io/envoyproxy/envoy:distroless-v1.36.2", "envoy"), ("docker.io/envoyproxy/gateway:v1.9.1", "envoy-gateway"),
     ("ghcr.io/kvgate/engine:0.1.0", None), ("example.com/echo-basic:1", None)],
)  # fmt: skip
def test_other_projects_images_run_as_their_binaries(image: str, binary: str | None) -> None:
    assert foreign_of(image) == binary


def test_gies_conformance_epp_is_played_by_kvgates_in_its_conformance_profile() -> None:
    stand_in = stand_in_of("registry.k8s.io/gateway-api-inference-extension/lwepp:v1.6.0")
    assert stand_in is not None
    component, command = stand_in
    assert component == "epp" and command[:3] == ["kvgate", "epp", "serve"]
    assert command[command.index("--profile") + 1] == "conformance"
    # the flags the suite's Deployment gives its EPP are kvgate's EPP's too
    import argparse

    from kvgate.epp.cli import configure_parser

    p = argparse.ArgumentParser()
    configure_parser(p)
    args = p.parse_args([*command[3:], "--pool-name", "primary-inference-pool", "--pool-namespace", "ns",
                         "--zap-encoder", "json", "--grpc-port", "9002", "--grpc-health-port", "9003"])  # fmt: skip
    assert (args.profile, args.flow_control, args.log_format, args.grpc_port) == (
        "conformance",
        False,
        "json",
        9002,
    )
    assert stand_in_of("ghcr.io/kvgate/epp:0.1.0") is None


@pytest.mark.parametrize(
    ("url", "loopback"),
    [("http://127.0.0.1:8080", True), ("http://127.5.6.7", True), ("http://localhost:1", True),
     ("http://[::1]:80", True), ("https://huggingface.co", False), ("http://10.0.0.1", False), ("", False)],
)  # fmt: skip
def test_only_a_loopback_hub_lifts_the_offline_guard(url: str, loopback: bool) -> None:
    assert _loopback_url(url) is loopback

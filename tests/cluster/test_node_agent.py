"""The node agent's pure parts; tests/cluster/test_workloads.py runs it against the API server."""

from __future__ import annotations

import pytest

from kvgate.testing.node_agent import _loopback_url, component_of


@pytest.mark.parametrize(
    ("image", "component"),
    [("ghcr.io/kvgate/engine:0.1.0", "engine"), ("localhost/kvgate-epp:dev", "epp"),
     ("ghcr.io/kvgate/operator@sha256:abc", "operator"), ("docker.io/envoyproxy/envoy:v1.40.0", None),
     ("engine-tools/other:1", None), ("", None)],
)  # fmt: skip
def test_only_kvgate_images_run_as_processes(image: str, component: str | None) -> None:
    assert component_of(image) == component


@pytest.mark.parametrize(
    ("url", "loopback"),
    [("http://127.0.0.1:8080", True), ("http://127.5.6.7", True), ("http://localhost:1", True),
     ("http://[::1]:80", True), ("https://huggingface.co", False), ("http://10.0.0.1", False), ("", False)],
)  # fmt: skip
def test_only_a_loopback_hub_lifts_the_offline_guard(url: str, loopback: bool) -> None:
    assert _loopback_url(url) is loopback

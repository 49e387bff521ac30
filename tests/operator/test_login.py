"""The operator in a pod logs in where client-go's InClusterConfig does: the API server at
$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, not kopf's https://kubernetes.default.svc,
which needs cluster DNS. Found on the real control plane (tests/cluster): the chart's operator
pod could not resolve kubernetes.default.svc and never logged in."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from kvgate.operator import handlers


def _service_account(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="t", default_namespace="ops")


@pytest.mark.parametrize(
    ("host", "port", "server"),
    [("10.96.0.1", "443", "https://10.96.0.1:443"), ("127.0.0.1", "6443", "https://127.0.0.1:6443"),
     ("fd00::1", "443", "https://[fd00::1]:443")],
)  # fmt: skip
def test_in_a_pod_the_operator_dials_the_service_address_from_the_env(
    monkeypatch: pytest.MonkeyPatch, host: str, port: str, server: str
) -> None:
    monkeypatch.setattr(kopf, "login_with_service_account", _service_account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    info = handlers._default_login()
    assert info.server == server and info.token == "t" and info.default_namespace == "ops"


def test_outside_a_pod_the_kubeconfig_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: None)
    monkeypatch.setattr(kopf, "login_with_kubeconfig", lambda **_: kopf.ConnectionInfo(server="https://k:1"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert handlers._default_login().server == "https://k:1"

"""The HTTPRoute that attaches the pool to Gateways."""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.crds import POOL_GROUP, ModelDeploymentSpec
from kvgate.operator.children.common import LABEL_MD, Owner, object_meta, standard_labels
from kvgate.operator.config import OperatorConfig


def http_route(name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig) -> dict[str, Any]:
    assert spec.http_route is not None
    route = spec.http_route
    labels = standard_labels(name, "route", {LABEL_MD: name, **config.extra_labels})
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
        "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": name}],
    }
    if route.request_timeout:
        rule["timeouts"] = {"request": route.request_timeout}
    body: dict[str, Any] = {
        "parentRefs": [p.wire() for p in route.parent_refs],
        "rules": [rule],
    }
    if route.hostnames:
        body["hostnames"] = list(route.hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": object_meta(name, owner, labels),
        "spec": body,
    }

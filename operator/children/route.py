"""The HTTPRoute that attaches the pool to Gateways (all of a path, or only its model names)."""

from __future__ import annotations

from typing import Any

from kvgate.api.contracts.model_routing import MODEL_NAME_HEADER  # GIE's body-based routing header
from kvgate.api.k8s.crds import POOL_GROUP, ModelDeploymentSpec
from kvgate.operator.children.common import LABEL_MD, Owner, object_meta, standard_labels
from kvgate.operator.config import OperatorConfig

MATCHES_PER_RULE = 64  # Gateway API's limit on matches in one HTTPRoute rule


def http_route(name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig) -> dict[str, Any]:
    assert spec.http_route is not None
    route = spec.http_route
    labels = standard_labels(name, "route", {LABEL_MD: name, **config.extra_labels})
    path = {"type": "PathPrefix", "value": route.path_prefix}
    if route.match_model_name:
        # One match per name the pool serves (the base model and each adapter), at most
        # MATCHES_PER_RULE per rule as Gateway API allows.
        names = [spec.model.effective_served_name(), *(a.name for a in spec.adapters)]
        match_sets = [
            [
                {"path": path, "headers": [{"type": "Exact", "name": MODEL_NAME_HEADER, "value": n}]}
                for n in chunk
            ]
            for chunk in (names[i : i + MATCHES_PER_RULE] for i in range(0, len(names), MATCHES_PER_RULE))
        ]
    else:
        match_sets = [[{"path": path}]]
    rules = []
    for matches in match_sets:
        rule: dict[str, Any] = {
            "matches": matches,
            "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": name}],
        }
        if route.request_timeout:
            rule["timeouts"] = {"request": route.request_timeout}
        rules.append(rule)
    body: dict[str, Any] = {
        "parentRefs": [p.wire() for p in route.parent_refs],
        "rules": rules,
    }
    if route.hostnames:
        body["hostnames"] = list(route.hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": object_meta(name, owner, labels),
        "spec": body,
    }

"""NetworkPolicies (ingress only) for the picker and the engines."""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.crds import ModelDeploymentSpec, NetworkPeer
from kvgate.operator.children.common import (
    EPP_GRPC_PORT,
    EPP_HEALTH_PORT,
    EPP_METRICS_PORT,
    LABEL_MD,
    LABEL_ROLE,
    Owner,
    engine_selector,
    epp_name,
    object_meta,
    standard_labels,
)
from kvgate.operator.config import OperatorConfig

#
# Egress stays open: the picker needs DNS, the API server (whose address a NetworkPolicy can
# only name by IP block) and the engines; engines may need a model hub. Kubelet probes come from
# the node and are allowed by the common CNIs (Calico, Cilium, GKE Dataplane V2) whatever the
# policy says, so the health port is opened to the gateway only (its EPP health checks).


# The chart's operator pods (charts/kvgate/templates/_helpers.tpl kvgate.operatorSelector), any namespace.
OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate-operator"}},
}

# The chart's model router pods (charts/kvgate/templates/model-router.yaml), any namespace.
MODEL_ROUTER_PEER = {
    "namespaceSelector": {"matchLabels": {}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate-model-router"}},
}


def _peers(peers: list[NetworkPeer]) -> list[dict[str, Any]]:
    return [p.wire() for p in peers]


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in sorted(set(ports))]


def network_policies(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The picker's and the engines' ingress policies; none when spec.networkPolicy is off."""
    policy = spec.network_policy
    if not policy.enabled:
        return []
    epp_pods = {LABEL_MD: name, LABEL_ROLE: "epp"}
    gateway, metrics = _peers(policy.gateway_from), _peers(policy.metrics_from)
    epp_rules: list[dict[str, Any]] = [{"from": gateway, "ports": _tcp(EPP_GRPC_PORT, EPP_HEALTH_PORT)}]
    eng = spec.engine
    engine_rules: list[dict[str, Any]] = [
        # The chart's model router (several pools behind one gateway) lists the engines' models.
        {"from": [*gateway, MODEL_ROUTER_PEER], "ports": _tcp(eng.port)},
        # The picker scrapes /metrics on the serving port and subscribes to KV events.
        {
            "from": [{"podSelector": {"matchLabels": epp_pods}}],
            "ports": _tcp(*(p for p in (eng.port, eng.kv_events_port, eng.kv_events_replay_port) if p)),
        },
    ]
    if spec.lora_enabled():
        # The operator loads and unloads adapters through the engines' API (the chart's operator pods).
        engine_rules.append({"from": [OPERATOR_PEER], "ports": _tcp(eng.port)})
    if spec.autoscaling.backend != "off":
        # An HPA's metric may come from the operator's External Metrics API, which reads the pickers.
        epp_rules.append({"from": [OPERATOR_PEER], "ports": _tcp(EPP_METRICS_PORT)})
    if metrics:
        epp_rules.append({"from": metrics, "ports": _tcp(EPP_METRICS_PORT)})
        # /metrics shares the serving port: scrapers reach the API too (the engine's API key guards it).
        engine_rules.append({"from": metrics, "ports": _tcp(eng.port)})
    out = []
    for policy_name, component, pods, rules in (
        (epp_name(name), "epp", epp_pods, epp_rules),
        (name, "engine", engine_selector(name), engine_rules),
    ):
        labels = standard_labels(name, component, {**pods, **config.extra_labels})
        out.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": object_meta(policy_name, owner, labels),
                "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": rules},
            }
        )
    return out

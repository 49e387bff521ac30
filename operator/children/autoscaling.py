"""Autoscaling: who owns the engine replica count, the PromQL on the EPP's pool gauges, and
KEDA's ScaledObject or an autoscaling/v2 HPA (External metric) standing in for it."""

from __future__ import annotations

from typing import Any

from kvgate.api.contracts.metrics import (
    LABEL_POOL_NAME,
    POOL_AVERAGE_KV_CACHE_UTILIZATION,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_SATURATION,
    SATURATION_KV_CACHE_UTILIZATION,
    SATURATION_QUEUE_DEPTH,
)
from kvgate.api.k8s.crds import AutoscalingSpec, ModelDeploymentSpec
from kvgate.operator.children.common import LABEL_MD, Capabilities, Owner, object_meta, standard_labels
from kvgate.operator.config import OperatorConfig


def pool_gauge(metric: str, pool: str) -> str:
    """PromQL for one of the EPP's pool gauges (the max over the pool's EPP replicas)."""
    return f'max({metric}{{{LABEL_POOL_NAME}="{pool}"}})'


def autoscaler_query(pool: str, metric: str) -> str:
    """The PromQL the autoscaler scales on: a pool-wide average from the EPP."""
    queue = pool_gauge(POOL_AVERAGE_QUEUE_SIZE, pool)
    kv = pool_gauge(POOL_AVERAGE_KV_CACHE_UTILIZATION, pool)
    if metric == "queue-size":
        return queue
    if metric == "kv-cache-utilization":
        return kv
    # api.contracts.metrics.saturation() = max(queue/5, kv/0.8), written without a binary max:
    # b + clamp_min(a - b, 0)
    a = f"({queue} / {_num(SATURATION_QUEUE_DEPTH)})"
    b = f"({kv} / {_num(SATURATION_KV_CACHE_UTILIZATION)})"
    return f"{b} + clamp_min({a} - {b}, 0)"


def _num(value: float) -> str:
    return f"{value:g}"


def scaled_object(
    name: str, owner: Owner, autoscaling: AutoscalingSpec, config: OperatorConfig
) -> dict[str, Any]:
    labels = standard_labels(name, "autoscaler", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_meta(name, owner, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "prometheus",
                    # The query is a per-endpoint average already: scale on its value, not per pod.
                    "metricType": "Value",
                    "metadata": {
                        "serverAddress": autoscaling.prometheus_address or config.keda_prometheus_address,
                        "query": autoscaler_query(name, autoscaling.metric),
                        "threshold": autoscaling.target,
                    },
                }
            ],
        },
    }


def external_metric_name(metric: str) -> str:
    return {
        "queue-size": POOL_AVERAGE_QUEUE_SIZE,
        "kv-cache-utilization": POOL_AVERAGE_KV_CACHE_UTILIZATION,
        "saturation": POOL_SATURATION,
    }[metric]


def horizontal_pod_autoscaler(
    name: str, owner: Owner, autoscaling: AutoscalingSpec, config: OperatorConfig
) -> dict[str, Any]:
    """autoscaling/v2 HPA on the pool metric as an External metric (needs a metrics adapter)."""
    labels = standard_labels(name, "autoscaler", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(name, owner, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            # Scaling to zero is KEDA's job; an HPA's floor is one replica.
            "minReplicas": max(1, autoscaling.min_replicas),
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": external_metric_name(autoscaling.metric),
                            "selector": {"matchLabels": {LABEL_POOL_NAME: name}},
                        },
                        "target": {"type": "Value", "value": autoscaling.target},
                    },
                }
            ],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds}
            },
        },
    }


def autoscaler_kind(autoscaling: AutoscalingSpec, caps: Capabilities) -> str | None:
    if autoscaling.backend == "off":
        return None
    if autoscaling.backend == "keda" and caps.keda:
        return "ScaledObject"
    return "HorizontalPodAutoscaler"


def desired_replicas(spec: ModelDeploymentSpec, autoscaled: bool, exists: bool) -> int | None:
    """The engine replica count to write; None keeps the live count (an autoscaler owns it)."""
    if spec.replicas is not None:
        return spec.replicas
    if not autoscaled:
        return 1
    return None if exists else max(1, spec.autoscaling.min_replicas)

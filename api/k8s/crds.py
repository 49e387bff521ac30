"""The custom resources kvgate serves and reads: their CRD declarations, and the one place
callers import the models from.

- `InferencePool` (`inference.networking.k8s.io/v1`) and `InferenceObjective`
  (`inference.networking.x-k8s.io/v1alpha2`) follow the Gateway API Inference Extension
  (GIE) v1 API field for field, so GIE's own examples and gateways work with them (`gie.py`).
- `ModelDeployment` (`kvgate.dev/v1alpha1`) is kvgate's own: one served model, from which the
  operator builds the engine Deployment, the InferencePool, the endpoint picker and the
  autoscaler (`model_deployment.py`).
- `base.py` holds what both groups share (the base models, patterns, `Condition`).

The declarations below map each kind to its model; they are the source of the CRD YAML
(`scripts/gen_crds.py` writes `crds/` and the chart's copy); a test fails when the YAML and the
models disagree. Every public name of the three model modules is re-exported here.
"""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.base import (
    CONDITION_REASON_PATTERN,
    CONDITION_TYPE_PATTERN,
    CONTROLLER_NAME_PATTERN,
    DNS_LABEL_PATTERN,
    GROUP_PATTERN,
    KIND_PATTERN,
    LABEL_VALUE_PATTERN,
    Condition,
    GIEModel,
    K8sModel,
    PortNumber,
)
from kvgate.api.k8s.crd_schema import CRDSpec, PrinterColumn
from kvgate.api.k8s.gie import (
    OBJECTIVE_GROUP,
    OBJECTIVE_VERSION,
    POOL_GROUP,
    POOL_VERSION,
    EndpointPickerRef,
    InferenceObjective,
    InferenceObjectiveSpec,
    InferenceObjectiveStatus,
    InferencePool,
    InferencePoolSpec,
    InferencePoolStatus,
    LabelSelector,
    ParentReference,
    ParentStatus,
    PoolObjectReference,
    Port,
)
from kvgate.api.k8s.model_deployment import (
    ADAPTER_CLAIMS_DIR,
    ADAPTER_DIR,
    ADAPTER_HF_DIR,
    ADAPTER_NAME_PATTERN,
    DEFAULT_GATEWAY_LABELS,
    DEFAULT_PD_THRESHOLD,
    DEFAULT_PROMETHEUS_LABELS,
    DEFAULT_PROMETHEUS_NAMESPACE,
    DURATION_PATTERN,
    KV_OFFLOAD_SIZE_MESSAGE,
    KV_OFFLOAD_SIZE_PATTERN,
    KVGATE_GROUP,
    KVGATE_VERSION,
    MODEL_SOURCE_PATTERN,
    PRECISE_PREFIX_SCORER,
    SECRET_KEY_PATTERN,
    SECRET_NAME_PATTERN,
    TENANTS_DIR,
    TOKEN_SCORERS,
    TOKENIZER_SOURCE_PATTERN,
    AdapterSpec,
    AdapterStatus,
    AutoscalerStatus,
    AutoscalingSpec,
    DisaggregationRoleSpec,
    DisaggregationSpec,
    EngineSpec,
    EnvVar,
    FlowControlSpec,
    HTTPRouteSpec,
    KubeLabelSelector,
    KVOffloadSpec,
    LabelSelectorRequirement,
    LoRASpec,
    ModelDeployment,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    ModelSource,
    NetworkPeer,
    NetworkPolicySpec,
    PoolSignals,
    ResourceRequirements,
    RouteParentRef,
    RoutingSpec,
    ScorerSpec,
    SourceKind,
    TenantsSpec,
    duration_seconds,
)

# ---------------------------------------------------------------------------------------------
# CRD declarations
# ---------------------------------------------------------------------------------------------

# GIE's CRDs carry the release they come from (its conformance suite reads it for its report):
# the release whose InferencePool and InferenceObjective schemas these match, and whose
# conformance suite docs/kubernetes.md reports against this project's gateway
GIE_BUNDLE_VERSION = "v1.6.0"
GIE_ANNOTATIONS = {"inference.networking.k8s.io/bundle-version": GIE_BUNDLE_VERSION}

INFERENCE_POOL_CRD = CRDSpec(
    group=POOL_GROUP,
    version=POOL_VERSION,
    kind="InferencePool",
    plural="inferencepools",
    model=InferencePool,
    short_names=("infpool",),
    columns=(
        PrinterColumn("Selector", ".spec.selector.matchLabels", priority=1),
        PrinterColumn("Port", ".spec.targetPorts[0].number", type="integer"),
        PrinterColumn("EPP", ".spec.endpointPickerRef.name"),
        PrinterColumn("Failure Mode", ".spec.endpointPickerRef.failureMode", priority=1),
        PrinterColumn("Accepted", '.status.parents[0].conditions[?(@.type=="Accepted")].status'),
        PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
    ),
    annotations={
        "api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173",
        **GIE_ANNOTATIONS,
    },
)

INFERENCE_OBJECTIVE_CRD = CRDSpec(
    group=OBJECTIVE_GROUP,
    version=OBJECTIVE_VERSION,
    kind="InferenceObjective",
    plural="inferenceobjectives",
    model=InferenceObjective,
    columns=(
        PrinterColumn("Inference Pool", ".spec.poolRef.name"),
        PrinterColumn("Priority", ".spec.priority", type="integer"),
        PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
    ),
    annotations=GIE_ANNOTATIONS,
)

MODEL_DEPLOYMENT_CRD = CRDSpec(
    group=KVGATE_GROUP,
    version=KVGATE_VERSION,
    kind="ModelDeployment",
    plural="modeldeployments",
    model=ModelDeployment,
    short_names=("md", "mdep"),
    categories=("kvgate",),
    scale={
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    },
    columns=(
        PrinterColumn("Model", ".spec.model.source"),
        PrinterColumn("Ready", ".status.readyReplicas", type="integer"),
        PrinterColumn("Replicas", ".status.replicas", type="integer"),
        PrinterColumn("Pool", ".status.pool"),
        PrinterColumn("Endpoints", ".status.endpoints", type="integer"),
        PrinterColumn("Status", '.status.conditions[?(@.type=="Ready")].reason'),
        PrinterColumn("Autoscaler", ".status.autoscaler.kind", priority=1),
        PrinterColumn("Queue", ".status.signals.queueSize", priority=1),
        PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
    ),
)

ALL_CRDS = (INFERENCE_POOL_CRD, INFERENCE_OBJECTIVE_CRD, MODEL_DEPLOYMENT_CRD)


def crd_manifests() -> list[dict[str, Any]]:
    return [crd.manifest() for crd in ALL_CRDS]


__all__ = [
    "ADAPTER_CLAIMS_DIR",
    "ADAPTER_DIR",
    "ADAPTER_HF_DIR",
    "ADAPTER_NAME_PATTERN",
    "ALL_CRDS",
    "CONDITION_REASON_PATTERN",
    "CONDITION_TYPE_PATTERN",
    "CONTROLLER_NAME_PATTERN",
    "DEFAULT_GATEWAY_LABELS",
    "DEFAULT_PD_THRESHOLD",
    "DEFAULT_PROMETHEUS_LABELS",
    "DEFAULT_PROMETHEUS_NAMESPACE",
    "DNS_LABEL_PATTERN",
    "DURATION_PATTERN",
    "GROUP_PATTERN",
    "INFERENCE_OBJECTIVE_CRD",
    "INFERENCE_POOL_CRD",
    "KIND_PATTERN",
    "KVGATE_GROUP",
    "KVGATE_VERSION",
    "KV_OFFLOAD_SIZE_MESSAGE",
    "KV_OFFLOAD_SIZE_PATTERN",
    "LABEL_VALUE_PATTERN",
    "MODEL_DEPLOYMENT_CRD",
    "MODEL_SOURCE_PATTERN",
    "OBJECTIVE_GROUP",
    "OBJECTIVE_VERSION",
    "POOL_GROUP",
    "POOL_VERSION",
    "PRECISE_PREFIX_SCORER",
    "SECRET_KEY_PATTERN",
    "SECRET_NAME_PATTERN",
    "TENANTS_DIR",
    "TOKENIZER_SOURCE_PATTERN",
    "TOKEN_SCORERS",
    "AdapterSpec",
    "AdapterStatus",
    "AutoscalerStatus",
    "AutoscalingSpec",
    "Condition",
    "DisaggregationRoleSpec",
    "DisaggregationSpec",
    "EndpointPickerRef",
    "EngineSpec",
    "EnvVar",
    "FlowControlSpec",
    "GIEModel",
    "HTTPRouteSpec",
    "InferenceObjective",
    "InferenceObjectiveSpec",
    "InferenceObjectiveStatus",
    "InferencePool",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "K8sModel",
    "KVOffloadSpec",
    "KubeLabelSelector",
    "LabelSelector",
    "LabelSelectorRequirement",
    "LoRASpec",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "ModelDeploymentStatus",
    "ModelSource",
    "NetworkPeer",
    "NetworkPolicySpec",
    "ParentReference",
    "ParentStatus",
    "PoolObjectReference",
    "PoolSignals",
    "Port",
    "PortNumber",
    "ResourceRequirements",
    "RouteParentRef",
    "RoutingSpec",
    "ScorerSpec",
    "SourceKind",
    "TenantsSpec",
    "crd_manifests",
    "duration_seconds",
]

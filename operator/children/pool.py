"""The InferencePool a ModelDeployment serves through (GIE v1, built with api.k8s.crds' models)."""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.crds import (
    POOL_GROUP,
    POOL_VERSION,
    EndpointPickerRef,
    InferencePoolSpec,
    LabelSelector,
    ModelDeploymentSpec,
    Port,
)
from kvgate.operator.children.common import (
    EPP_GRPC_PORT,
    LABEL_MD,
    Owner,
    engine_selector,
    epp_name,
    object_meta,
    standard_labels,
)
from kvgate.operator.config import OperatorConfig


def inference_pool(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    labels = standard_labels(name, "pool", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": object_meta(name, owner, labels),
        "spec": InferencePoolSpec(
            selector=LabelSelector(match_labels=engine_selector(name)),
            target_ports=[Port(number=spec.engine.port)],
            app_protocol="http",
            endpoint_picker_ref=EndpointPickerRef(
                group="",
                kind="Service",
                name=epp_name(name),
                port=Port(number=EPP_GRPC_PORT),
                failure_mode=spec.routing.failure_mode,
            ),
        ).wire(),
    }

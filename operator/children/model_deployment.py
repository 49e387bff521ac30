"""Every child a ModelDeployment should have, in creation order, and the optional ones."""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator.children.adapters import adapters_config_map
from kvgate.operator.children.autoscaling import (
    autoscaler_kind,
    desired_replicas,
    horizontal_pod_autoscaler,
    scaled_object,
)
from kvgate.operator.children.common import Capabilities, Owner
from kvgate.operator.children.disaggregation import (
    AGGREGATED_CHILDREN,
    DISAGGREGATED_CHILDREN,
    disaggregated_children,
)
from kvgate.operator.children.engine import engine_deployment, engine_pdb
from kvgate.operator.children.epp import epp_objects, epp_target_for_md
from kvgate.operator.children.network import network_policies
from kvgate.operator.children.pool import inference_pool
from kvgate.operator.children.route import http_route
from kvgate.operator.config import OperatorConfig


def model_deployment_children(
    name: str,
    owner: Owner,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    caps: Capabilities,
    engine_exists: bool = False,
    existing_roles: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Every child a ModelDeployment should have right now, in creation order. `existing_roles`:
    the disaggregated roles whose engine Deployment exists (spec.disaggregation)."""
    if spec.disaggregation is not None:
        return disaggregated_children(name, owner, spec, config, caps, existing_roles)
    scaler = autoscaler_kind(spec.autoscaling, caps)
    children = [
        *epp_objects(epp_target_for_md(name, owner, spec, config), config),
        inference_pool(name, owner, spec, config),
        # Before the engines: their adapter sidecar mounts it.
        *([adapters_config_map(name, owner, spec, config)] if spec.lora_enabled() else []),
        engine_deployment(
            name, owner, spec, config, desired_replicas(spec, scaler is not None, engine_exists)
        ),
        engine_pdb(name, owner, config),
        *network_policies(name, owner, spec, config),
    ]
    if scaler == "ScaledObject":
        children.append(scaled_object(name, owner, spec.autoscaling, config))
    elif scaler == "HorizontalPodAutoscaler":
        children.append(horizontal_pod_autoscaler(name, owner, spec.autoscaling, config))
    if spec.http_route is not None and caps.gateway_api:
        children.append(http_route(name, owner, spec, config))
    return children


# Children a ModelDeployment may or may not have, as (kind, name suffix); one not desired now is
# deleted if we own it.
OPTIONAL_CHILDREN = (
    ("ScaledObject", ""),
    ("HorizontalPodAutoscaler", ""),
    ("HTTPRoute", ""),
    ("NetworkPolicy", ""),
    ("NetworkPolicy", "-epp"),
    ("ConfigMap", "-adapters"),
    *AGGREGATED_CHILDREN,
    *DISAGGREGATED_CHILDREN,
)

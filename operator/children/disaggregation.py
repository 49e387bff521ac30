"""Prefill/decode disaggregation (spec.disaggregation): the children of a split ModelDeployment.

Two engine Deployments, `<name>-prefill` (`--kv-role producer`) and `<name>-decode`
(`--kv-role consumer`), whose pods carry the role in `kvgate.dev/role` (the label the picker
reads: api/contracts/disaggregation.py). One InferencePool selects both; the picker runs with
`--pd-threshold` and only ever makes decode engines the destination. Each role gets its own
PodDisruptionBudget, autoscaler (on its own engines' queue) and NetworkPolicy: only decode
engines take the gateway's traffic, and prefill engines take the decode engines' pulls.

The engines sign KV transfers with a secret the pool shares (`KVGATE_KV_TRANSFER_SECRET`), kept
in the Secret `<name>-kv-transfer`; its random value is made once by the operator
(operator/disaggregation_pass.py), never here, so a resync never changes it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

from kvgate.api.contracts.disaggregation import ROLE_DECODE, ROLE_PREFILL
from kvgate.api.contracts.metrics import (
    LABEL_MODEL_SERVER_POD,
    LABEL_POOL_NAME,
    NUM_REQUESTS_WAITING,
    POOL_PER_POD_QUEUE_SIZE,
)
from kvgate.api.k8s.crds import AutoscalingSpec, DisaggregationRoleSpec, EnvVar, ModelDeploymentSpec
from kvgate.operator.children.autoscaling import (
    autoscaler_kind,
    horizontal_pod_autoscaler,
    scaled_object,
)
from kvgate.operator.children.common import LABEL_MD, LABEL_ROLE, Capabilities, Owner
from kvgate.operator.children.engine import engine_deployment, engine_pdb
from kvgate.operator.children.epp import epp_objects, epp_target_for_md
from kvgate.operator.children.network import network_policies
from kvgate.operator.children.pool import inference_pool
from kvgate.operator.children.route import http_route
from kvgate.operator.config import OperatorConfig

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = (ROLE_PREFILL, ROLE_DECODE)  # type: ignore[assignment]
# vLLM's kv_role names, as `kvgate engine serve --kv-role` takes them.
KV_ROLE: dict[str, str] = {ROLE_PREFILL: "producer", ROLE_DECODE: "consumer"}
KV_SECRET_ENV = "KVGATE_KV_TRANSFER_SECRET"
KV_SECRET_KEY = "secret"
# Engine pods of either role (and the aggregated engines) carry this; the picker's pods do not.
COMPONENT_LABEL = "app.kubernetes.io/component"
# The per-role autoscaler finds a role's pods by name (`<name>-<role>-<replicaset hash>-<id>`):
# the pod name is cut to 58 characters before its random suffix, so `<name>-prefill-` must fit.
MAX_DISAGGREGATED_NAME = 58 - len("-prefill-")


def role_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def role_selector(name: str, role: str) -> dict[str, str]:
    return {LABEL_MD: name, LABEL_ROLE: role}


def pool_selector(name: str) -> dict[str, str]:
    """Both roles' engine pods (not the picker's): the InferencePool's selector."""
    return {LABEL_MD: name, COMPONENT_LABEL: "engine"}


def kv_transfer_secret_name(name: str) -> str:
    return f"{name}-kv-transfer"


def own_secret_wanted(spec: ModelDeploymentSpec) -> bool:
    """Whether the operator keeps the transfer Secret: not when spec.engine.env brings its own."""
    return spec.disaggregation is not None and not any(e.name == KV_SECRET_ENV for e in spec.engine.env)


def _role(spec: ModelDeploymentSpec, role: str) -> DisaggregationRoleSpec:
    assert spec.disaggregation is not None
    return spec.disaggregation.prefill if role == ROLE_PREFILL else spec.disaggregation.decode


def role_engine_spec(name: str, spec: ModelDeploymentSpec, role: str) -> ModelDeploymentSpec:
    """The spec one role's engines run: its kv role, its args and resources, the shared secret."""
    rs, eng = _role(spec, role), spec.engine
    env = list(eng.env)
    if own_secret_wanted(spec):
        ref = {"secretKeyRef": {"name": kv_transfer_secret_name(name), "key": KV_SECRET_KEY}}
        env.append(EnvVar(name=KV_SECRET_ENV, value_from=ref))
    engine = eng.model_copy(
        update={
            "args": ["--kv-role", KV_ROLE[role], *eng.args, *rs.args],
            "resources": rs.resources or eng.resources,
            "env": env,
        }
    )
    return spec.model_copy(update={"engine": engine, "disaggregation": None})


def _relabel(obj: dict[str, Any], role: str) -> None:
    """engine_selector's `kvgate.dev/role: engine` becomes the role, wherever a label map has it."""
    if isinstance(obj, dict):
        if obj.get(LABEL_ROLE) == "engine":
            obj[LABEL_ROLE] = role
        for value in obj.values():
            _relabel(value, role)
    elif isinstance(obj, list):
        for value in obj:
            _relabel(value, role)


def role_bounds(spec: ModelDeploymentSpec, role: str) -> AutoscalingSpec:
    rs, scaling = _role(spec, role), spec.autoscaling
    return scaling.model_copy(
        update={
            "min_replicas": scaling.min_replicas if rs.min_replicas is None else rs.min_replicas,
            "max_replicas": scaling.max_replicas if rs.max_replicas is None else rs.max_replicas,
        }
    )


def role_replicas(spec: ModelDeploymentSpec, role: str, autoscaled: bool, exists: bool) -> int | None:
    """The count to write for one role; None keeps the live count (its autoscaler owns it)."""
    rs = _role(spec, role)
    if rs.replicas is not None:
        return rs.replicas
    if not autoscaled:
        return 1
    return None if exists else max(1, role_bounds(spec, role).min_replicas)


def role_deployment(
    name: str,
    owner: Owner,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    role: str,
    replicas: int | None,
) -> dict[str, Any]:
    dep = engine_deployment(name, owner, role_engine_spec(name, spec, role), config, replicas)
    dep["metadata"]["name"] = role_name(name, role)
    _relabel(dep["metadata"]["labels"], role)
    _relabel(dep["spec"]["selector"], role)
    _relabel(dep["spec"]["template"]["metadata"]["labels"], role)
    return dep


def role_pdb(name: str, owner: Owner, config: OperatorConfig, role: str) -> dict[str, Any]:
    pdb = engine_pdb(name, owner, config)
    pdb["metadata"]["name"] = role_name(name, role)
    _relabel(pdb, role)
    return pdb


def role_queue_query(name: str, role: str) -> str:
    """PromQL: the mean waiting queue over one role's engines, from the picker's per-endpoint
    gauge (max over the picker replicas, which agree); the role's pods matched by name."""
    pods = f'{LABEL_MODEL_SERVER_POD}=~"{role_name(name, role)}-.+"'
    series = f'{POOL_PER_POD_QUEUE_SIZE}{{{LABEL_POOL_NAME}="{name}",{pods}}}'
    return f"avg(max by ({LABEL_MODEL_SERVER_POD}) ({series}))"


def role_scaled_object(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig, role: str
) -> dict[str, Any]:
    obj = scaled_object(name, owner, role_bounds(spec, role), config)
    obj["metadata"]["name"] = role_name(name, role)
    obj["metadata"]["labels"][LABEL_ROLE] = role
    obj["spec"]["scaleTargetRef"]["name"] = role_name(name, role)
    obj["spec"]["triggers"][0]["metadata"]["query"] = role_queue_query(name, role)
    return obj


def role_hpa(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig, role: str
) -> dict[str, Any]:
    """An HPA on the role's own engines' waiting queue: a Pods metric (the engines' vLLM gauge,
    averaged by the HPA over exactly this Deployment's pods; needs a custom-metrics adapter)."""
    hpa = horizontal_pod_autoscaler(name, owner, role_bounds(spec, role), config)
    hpa["metadata"]["name"] = role_name(name, role)
    hpa["metadata"]["labels"][LABEL_ROLE] = role
    hpa["spec"]["scaleTargetRef"]["name"] = role_name(name, role)
    hpa["spec"]["metrics"] = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": NUM_REQUESTS_WAITING},
                "target": {"type": "AverageValue", "averageValue": spec.autoscaling.target},
            },
        }
    ]
    return hpa


def role_network_policies(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The picker's policy as aggregated, and one engine policy per role: decode engines admit
    what aggregated engines admit; prefill engines admit the decode engines (the hand-off: the
    prefill call and the block pull, both on the serving port) and the picker and scrapers, never
    the gateway."""
    policies = network_policies(name, owner, spec, config)
    if not policies:
        return []
    epp_policy, engine_policy = policies
    rules = engine_policy["spec"]["ingress"]
    # network_policies' first engine rule is the gateway's (and the model router's).
    pulls = {
        "from": [{"podSelector": {"matchLabels": role_selector(name, ROLE_DECODE)}}],
        "ports": [{"protocol": "TCP", "port": spec.engine.port}],
    }
    out = [epp_policy]
    for role, ingress in ((ROLE_PREFILL, [pulls, *rules[1:]]), (ROLE_DECODE, rules)):
        policy = copy.deepcopy(engine_policy)
        policy["metadata"]["name"] = role_name(name, role)
        _relabel(policy["metadata"]["labels"], role)
        policy["spec"]["podSelector"] = {"matchLabels": role_selector(name, role)}
        policy["spec"]["ingress"] = copy.deepcopy(ingress)
        out.append(policy)
    return out


def disaggregated_children(
    name: str,
    owner: Owner,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    caps: Capabilities,
    existing_roles: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Every child a disaggregated ModelDeployment should have right now, in creation order
    (the transfer Secret apart: operator/disaggregation_pass.py makes it once)."""
    assert spec.disaggregation is not None
    target = dataclasses.replace(
        epp_target_for_md(name, owner, spec, config), pd_threshold=spec.disaggregation.threshold
    )
    pool = inference_pool(name, owner, spec, config)
    pool["spec"]["selector"] = {"matchLabels": pool_selector(name)}
    scaler = autoscaler_kind(spec.autoscaling, caps)
    children = [*epp_objects(target, config), pool]
    for role in ROLES:
        replicas = role_replicas(spec, role, scaler is not None, role in existing_roles)
        children.append(role_deployment(name, owner, spec, config, role, replicas))
    children += [role_pdb(name, owner, config, role) for role in ROLES]
    children += role_network_policies(name, owner, spec, config)
    for role in ROLES:
        if scaler == "ScaledObject":
            children.append(role_scaled_object(name, owner, spec, config, role))
        elif scaler == "HorizontalPodAutoscaler":
            children.append(role_hpa(name, owner, spec, config, role))
    if spec.http_route is not None and caps.gateway_api:
        children.append(http_route(name, owner, spec, config))
    return children


# Children only a disaggregated ModelDeployment has, as (kind, name suffix): deleted once it is not.
DISAGGREGATED_CHILDREN = tuple(
    (kind, f"-{role}")
    for role in ROLES
    for kind in (
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ScaledObject",
        "HorizontalPodAutoscaler",
    )
)
# Children only an aggregated one has: deleted once it is disaggregated.
AGGREGATED_CHILDREN = (("Deployment", ""), ("PodDisruptionBudget", ""))

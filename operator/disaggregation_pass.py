"""A disaggregated ModelDeployment's pass-time parts: the shared KV-transfer Secret (made once,
never rewritten), which role Deployments exist, and the status read back from both roles.

The builders are pure (children/disaggregation.py); this module talks to the API server for
the Secret only, and turns the two role Deployments into the status conditions the aggregated
path reports (status.py), plus a Disaggregation condition with each role's numbers.
"""

from __future__ import annotations

from typing import Any

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.children.disaggregation import (
    KV_ROLE,
    KV_SECRET_KEY,
    MAX_DISAGGREGATED_NAME,
    ROLES,
    kv_transfer_secret_name,
    own_secret_wanted,
    pool_selector,
    role_name,
    role_queue_query,
)
from kvgate.operator.conditions import Cond
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import KubeClient
from kvgate.operator.own_secrets import ensure_random_secret
from kvgate.operator.resources import DEPLOYMENTS
from kvgate.operator.status import StatusReport, model_deployment_status


def name_problem(name: str, spec: ModelDeploymentSpec) -> str | None:
    if spec.disaggregation is not None and len(name) > MAX_DISAGGREGATED_NAME:
        return (
            f"metadata.name: at most {MAX_DISAGGREGATED_NAME} characters with disaggregation (each role's "
            f"autoscaler finds its pods by the name prefix <name>-prefill-, which pod names keep only that long)"
        )
    return None


async def existing_roles(
    client: KubeClient, namespace: str, name: str, spec: ModelDeploymentSpec
) -> frozenset[str]:
    if spec.disaggregation is None:
        return frozenset()
    return frozenset(
        [
            role
            for role in ROLES
            if await client.get(DEPLOYMENTS, namespace, role_name(name, role)) is not None
        ]
    )


async def ensure_kv_transfer_secret(
    client: KubeClient, owner: ch.Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> str:
    """Creates `<name>-kv-transfer` with a random key if it is missing (operator/own_secrets.py).
    Returns what was done: created, refilled, unchanged or not-wanted."""
    if not own_secret_wanted(spec):
        return "not-wanted"
    name = kv_transfer_secret_name(owner.name)
    return await ensure_random_secret(client, owner, config, name, KV_SECRET_KEY, "kv-transfer")


def _ready(dep: dict[str, Any]) -> tuple[int, int]:
    return int((dep.get("status") or {}).get("readyReplicas") or 0), int(
        (dep.get("spec") or {}).get("replicas") or 0
    )


def combined_engine(deployments: list[dict[str, Any]]) -> dict[str, Any]:
    """The role Deployments read back as one engine Deployment, for status.py's rollout rules:
    counts summed, rolled out only when every role is, the first failure either role reports."""
    total: dict[str, int] = {"readyReplicas": 0, "updatedReplicas": 0, "replicas": 0}
    want, rolled = 0, True
    conditions: list[dict[str, Any]] = []
    for dep in deployments:
        status = dep.get("status") or {}
        for key in total:
            total[key] += int(status.get(key) or 0)
        want += int((dep.get("spec") or {}).get("replicas") or 0)
        seen = status.get("observedGeneration")
        rolled = rolled and (seen is None or seen >= (dep.get("metadata") or {}).get("generation", 0))
        for cond in status.get("conditions") or []:
            failed = (
                cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded"
            ) or (cond.get("type") == "ReplicaFailure" and cond.get("status") == "True")
            if failed and not conditions:
                conditions.append(cond)
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": want},
        "status": {**total, "observedGeneration": 1 if rolled else 0, "conditions": conditions},
    }


def disaggregated_status(
    name: str,
    spec: ModelDeploymentSpec,
    caps: ch.Capabilities,
    live: dict[str, dict[str, Any]],
    old_conditions: list[dict[str, Any]] | None,
) -> StatusReport:
    """status.py's report over both roles, with what differs when the pool is split: Ready needs a
    decode engine (prefill engines are never a destination), the selector is the pool's, the
    autoscaler scales each role on its own queue, and a Disaggregation condition per role."""
    assert spec.disaggregation is not None
    deps = {role: live[f"Deployment/{role_name(name, role)}"] for role in ROLES}
    report = model_deployment_status(
        name,
        spec,
        caps,
        engine=combined_engine(list(deps.values())),
        epp=live[f"Deployment/{ch.epp_name(name)}"],
        pool=live[f"InferencePool/{name}"],
        old_conditions=old_conditions,
    )
    (p_ready, p_want), (d_ready, d_want) = _ready(deps["prefill"]), _ready(deps["decode"])
    conds = report.conditions
    if d_want > 0 and d_ready == 0:
        msg = f"0/{d_want} decode engines ready; prefill engines ({p_ready} ready) are never a destination."
        conds = [Cond("Ready", "False", "EngineNotReady", msg) if c.type == "Ready" else c for c in conds]
    scaler = ch.autoscaler_kind(spec.autoscaling, caps)
    if scaler is not None:
        queries = "; ".join(f"{role_name(name, r)}: {role_queue_query(name, r)}" for r in ROLES)
        how = f"KEDA ScaledObjects scale each role on its engines' queue ({queries})"
        if scaler == "HorizontalPodAutoscaler":
            how = (
                "HorizontalPodAutoscalers scale each role on its own pods' vllm:num_requests_waiting "
                "(a Pods metric; needs a custom-metrics adapter)"
            )
        if scaler == "HorizontalPodAutoscaler" and spec.autoscaling.backend == "keda":
            how = "KEDA's ScaledObject API is not served in this cluster: " + how
        conds = [Cond(c.type, c.status, c.reason, how + ".") if c.type == "Autoscaling" else c for c in conds]
        report.query = role_queue_query(name, "decode") if scaler == "ScaledObject" else None
        report.fields["autoscaler"] = {"kind": scaler, "query": report.query}
    threshold = spec.disaggregation.threshold
    numbers = (
        f"prefill {p_ready}/{p_want} ready ({role_name(name, 'prefill')}, --kv-role {KV_ROLE['prefill']}), "
        f"decode {d_ready}/{d_want} ready ({role_name(name, 'decode')}, --kv-role {KV_ROLE['decode']})"
    )
    if p_want > 0 and p_ready == 0:
        split = Cond(
            "Disaggregation",
            "False",
            "NoPrefillEngineReady",
            f"{numbers}: decode engines prefill every prompt themselves until a prefill engine is ready.",
        )
    else:
        split = Cond(
            "Disaggregation",
            "True",
            "Split",
            f"{numbers}; prompts with more than {threshold} uncached tokens are prefilled on a prefill engine.",
        )
    conds.append(split)
    report.conditions = conds
    report.fields["selector"] = ",".join(f"{k}={v}" for k, v in pool_selector(name).items())
    return report

"""What a ModelDeployment's status says, from its children as read back after a pass.

Pure: the live engine and picker Deployments and the InferencePool in, the status fields,
conditions and events out. No API calls, so every case (a rollout stuck on its progress
deadline, a picker not ready, a gateway refusing the pool) is a plain unit test; reconcile.py
reads the children, calls this, and adds the Prometheus-backed Metrics condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvgate.api.k8s.crds import InferencePoolSpec, InferencePoolStatus, ModelDeploymentSpec, TenantsSpec
from kvgate.operator import children as ch
from kvgate.operator.conditions import Cond, find


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class StatusReport:
    """The status fields (conditions apart), the conditions in order, and events to post."""

    fields: dict[str, Any]
    conditions: list[Cond]
    events: list[Event] = field(default_factory=list)
    query: str | None = None  # the autoscaler's PromQL, when there is an autoscaler


@dataclass(frozen=True)
class Rollout:
    """The engine Deployment's and the picker Deployment's numbers, as read back."""

    want: int
    ready: int
    updated: int
    replicas: int
    rolled: bool  # the Deployment controller has seen the latest spec
    epp_want: int
    epp_ready: int

    @classmethod
    def of(cls, engine: dict[str, Any], epp: dict[str, Any]) -> Rollout:
        es = engine.get("status") or {}
        seen = es.get("observedGeneration")
        return cls(
            want=int((engine.get("spec") or {}).get("replicas") or 0),
            ready=int(es.get("readyReplicas") or 0),
            updated=int(es.get("updatedReplicas") or 0),
            replicas=int(es.get("replicas") or 0),
            rolled=seen is None or seen >= (engine.get("metadata") or {}).get("generation", 0),
            epp_want=int((epp.get("spec") or {}).get("replicas") or 0),
            epp_ready=int((epp.get("status") or {}).get("readyReplicas") or 0),
        )


def rollout_conditions(name: str, engine: dict[str, Any], epp: dict[str, Any]) -> list[Cond]:
    """Ready, Progressing and Degraded from the engine and picker Deployments."""
    r = Rollout.of(engine, epp)
    conds: list[Cond] = []
    if r.want == 0:
        conds.append(Cond("Ready", "False", "ScaledToZero", "No engine replicas are wanted right now."))
    elif r.ready == 0:
        msg = f"0/{r.want} engine replicas ready (loading weights?)."
        conds.append(Cond("Ready", "False", "EngineNotReady", msg))
    elif r.epp_ready == 0:
        conds.append(Cond("Ready", "False", "EndpointPickerNotReady", "The endpoint picker is not ready."))
    else:
        # One Ready picker routes the whole pool; fewer than wanted is worth saying, not failing.
        pickers = f"{r.epp_ready}/{r.epp_want} endpoint pickers ready"
        msg = f"{r.ready}/{r.want} engine replicas ready behind pool {name}; {pickers}."
        conds.append(Cond("Ready", "True", "Available", msg))
    if r.ready < r.want or r.updated < r.want or not r.rolled:
        msg = f"{r.updated}/{r.want} updated, {r.ready}/{r.want} ready."
        conds.append(Cond("Progressing", "True", "RollingOut", msg))
    else:
        conds.append(Cond("Progressing", "False", "Complete", "All engine replicas are updated and ready."))
    engine_conditions = (engine.get("status") or {}).get("conditions")
    deadline = find(engine_conditions, "Progressing")
    failure = find(engine_conditions, "ReplicaFailure")
    if deadline and deadline.get("reason") == "ProgressDeadlineExceeded":
        conds.append(Cond("Degraded", "True", "ProgressDeadlineExceeded", deadline.get("message", "")))
    elif failure and failure.get("status") == "True":
        conds.append(Cond("Degraded", "True", "ReplicaFailure", failure.get("message", "")))
    else:
        conds.append(Cond("Degraded", "False", "AsExpected", "No problems seen."))
    return conds


def autoscaling_condition(
    name: str, spec: ModelDeploymentSpec, caps: ch.Capabilities, old_conditions: list[dict[str, Any]] | None
) -> tuple[Cond, list[Event]]:
    """Which autoscaler runs and on what; a Warning the first time an HPA stands in for KEDA."""
    scaler = ch.autoscaler_kind(spec.autoscaling, caps)
    if scaler is None:
        return Cond("Autoscaling", "False", "Disabled", "spec.autoscaling.backend is off."), []
    if spec.autoscaling.backend == "keda" and scaler == "HorizontalPodAutoscaler":
        msg = (
            "KEDA's ScaledObject API is not served in this cluster; an autoscaling/v2 "
            "HorizontalPodAutoscaler on the External metric "
            f"{ch.external_metric_name(spec.autoscaling.metric)} is used instead (needs a metrics adapter)."
        )
        first = (find(old_conditions, "Autoscaling") or {}).get("reason") != "HPAFallback"
        return Cond("Autoscaling", "True", "HPAFallback", msg), [
            Event("Warning", "HPAFallback", msg)
        ] if first else []
    if scaler == "ScaledObject":
        query = ch.autoscaler_query(name, spec.autoscaling.metric)
        return Cond("Autoscaling", "True", "KEDA", f"KEDA ScaledObject {name} scales on: {query}"), []
    return Cond("Autoscaling", "True", "HPA", f"HorizontalPodAutoscaler {name} (External metric)."), []


def routed_condition(name: str, spec: ModelDeploymentSpec, caps: ch.Capabilities) -> Cond | None:
    if spec.http_route is None:
        return None
    if not caps.gateway_api:
        return Cond("Routed", "False", "GatewayAPIMissing", "HTTPRoute is not served; no route was created.")
    if spec.http_route.match_model_name:
        names = ", ".join([spec.model.effective_served_name(), *(a.name for a in spec.adapters)])
        msg = f"HTTPRoute {name} sends requests with X-Gateway-Model-Name {names} to pool {name}."
        return Cond("Routed", "True", "HTTPRouteApplied", msg[:4000])
    return Cond("Routed", "True", "HTTPRouteApplied", f"HTTPRoute {name} points at pool {name}.")


def gateway_accepted(pool: dict[str, Any]) -> tuple[str, Cond]:
    """The gateways' Accepted condition on the pool, read only (the gateway owns it)."""
    try:
        status = InferencePoolStatus.model_validate(pool.get("status") or {})
    except ValidationError as exc:
        msg = f"The pool's status (written by its gateways) does not parse: {problems(exc, 'status')}"
        return "Unknown", Cond("GatewayAccepted", "Unknown", "InvalidPoolStatus", msg[:1000])
    found = [
        next(c for c in p.conditions or [] if c.type == "Accepted")
        for p in status.parents or []
        if any(c.type == "Accepted" for c in p.conditions or [])
    ]
    if not found:
        return "Unknown", Cond(
            "GatewayAccepted", "Unknown", "NoParents", "No gateway reports on this pool yet."
        )
    worst = next((c for c in found if c.status == "False"), None) or next(
        (c for c in found if c.status != "True"), None
    )
    chosen = worst or found[0]
    msg = f"{len(found)} gateway(s); {chosen.message}"
    return chosen.status, Cond("GatewayAccepted", chosen.status, chosen.reason, msg.strip())


def model_deployment_status(
    name: str,
    spec: ModelDeploymentSpec,
    caps: ch.Capabilities,
    engine: dict[str, Any],
    epp: dict[str, Any],
    pool: dict[str, Any],
    old_conditions: list[dict[str, Any]] | None = None,
) -> StatusReport:
    """Status fields, conditions (Ready, Progressing, Degraded, Autoscaling, [Routed],
    GatewayAccepted) and events for a ModelDeployment whose children read back as given."""
    r = Rollout.of(engine, epp)
    conds = rollout_conditions(name, engine, epp)
    autoscaling, events = autoscaling_condition(name, spec, caps, old_conditions)
    conds.append(autoscaling)
    routed = routed_condition(name, spec, caps)
    if routed is not None:
        conds.append(routed)
    accepted, accepted_cond = gateway_accepted(pool)
    conds.append(accepted_cond)
    scaler = ch.autoscaler_kind(spec.autoscaling, caps)
    query = ch.autoscaler_query(name, spec.autoscaling.metric) if scaler else None
    ports = len(InferencePoolSpec.model_validate(pool["spec"]).target_ports)
    fields: dict[str, Any] = {
        "replicas": r.replicas,
        "readyReplicas": r.ready,
        "endpoints": r.ready * ports,
        "pool": name,
        "selector": ",".join(f"{k}={v}" for k, v in ch.engine_selector(name).items()),
        "gatewayAccepted": accepted,
        "autoscaler": {"kind": scaler or "none", "query": query},
    }
    return StatusReport(fields, conds, events, query)


def tenants_problem(tenants: TenantsSpec, secret: dict[str, Any] | None) -> tuple[str, str] | None:
    """Why the endpoint picker cannot read spec.tenants' file, as (reason, message), from its
    Secret as read (None: absent); None when the file is there."""
    name = tenants.secret_name
    if secret is None:
        return "TenantsSecretNotFound", (
            f"Secret {name} (spec.tenants.secretName) does not exist in this namespace: the endpoint "
            "picker pods cannot start (their tenants volume does not mount) until it does."
        )
    data = secret.get("data") or {}
    if tenants.key not in data:
        keys = ", ".join(sorted(data)) or "none"
        return "TenantsKeyNotFound", (
            f"Secret {name} has no key {tenants.key!r} (spec.tenants.key; its keys: {keys}): the endpoint "
            "picker exits with 'cannot read tenants file'."
        )
    return None


def degraded_by(
    conds: list[Cond], reason: str, message: str, old_conditions: list[dict[str, Any]] | None
) -> tuple[list[Cond], list[Event]]:
    """The conditions with Degraded True for this problem (after any problem Degraded already
    names), the picker's not-ready Ready saying why, and a Warning event the first time."""
    out: list[Cond] = []
    for c in conds:
        if c.type == "Degraded":
            c = (
                Cond("Degraded", "True", c.reason, f"{c.message} Also: {message}")
                if c.status == "True"
                else Cond("Degraded", "True", reason, message)
            )
        elif c.type == "Ready" and c.reason == "EndpointPickerNotReady":
            c = Cond("Ready", c.status, c.reason, f"{c.message} {message}")
        out.append(c)
    first = message not in (find(old_conditions, "Degraded") or {}).get("message", "")
    return out, [Event("Warning", reason, message)] if first else []


def problems(exc: ValidationError, root: str = "") -> str:
    """pydantic's errors as `path.to.field: message; ...`, paths in the wire's camelCase."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        out.append(f"{root + '.' if root else ''}{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(out)

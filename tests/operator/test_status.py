"""A ModelDeployment's status from its children as read back: the pure half of a pass, no API."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.conditions import Cond
from kvgate.operator.status import (
    degraded_by,
    gateway_accepted,
    model_deployment_status,
    rollout_conditions,
    tenants_problem,
)

NAME = "smol"


def engine(
    want: int = 2,
    ready: int = 2,
    updated: int = 2,
    generation: int = 3,
    observed: int | None = 3,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"replicas": want, "readyReplicas": ready, "updatedReplicas": updated}
    if observed is not None:
        status["observedGeneration"] = observed
    if conditions:
        status["conditions"] = conditions
    return {"metadata": {"generation": generation}, "spec": {"replicas": want}, "status": status}


def epp(want: int = 2, ready: int = 2) -> dict[str, Any]:
    return {"spec": {"replicas": want}, "status": {"readyReplicas": ready}}


def pool(parents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}
    }
    if parents is not None:
        body["status"] = {"parents": parents}
    return body


def by_type(conds: list[Cond]) -> dict[str, Cond]:
    return {c.type: c for c in conds}


def test_all_ready_and_rolled_out() -> None:
    conds = by_type(rollout_conditions(NAME, engine(), epp(2, 1)))
    assert list(conds) == ["Ready", "Progressing", "Degraded"]
    assert (conds["Ready"].status, conds["Ready"].reason) == ("True", "Available")
    assert "2/2 engine replicas ready behind pool smol; 1/2 endpoint pickers ready" in conds["Ready"].message
    assert (conds["Progressing"].status, conds["Progressing"].reason) == ("False", "Complete")
    assert (conds["Degraded"].status, conds["Degraded"].reason) == ("False", "AsExpected")


@pytest.mark.parametrize(
    ("eng", "pickers", "reason"),
    [
        (engine(want=0, ready=0, updated=0), epp(), "ScaledToZero"),
        (engine(ready=0), epp(), "EngineNotReady"),
        (engine(), epp(ready=0), "EndpointPickerNotReady"),
    ],
)
def test_not_ready(eng: dict[str, Any], pickers: dict[str, Any], reason: str) -> None:
    ready = by_type(rollout_conditions(NAME, eng, pickers))["Ready"]
    assert (ready.status, ready.reason) == ("False", reason)


@pytest.mark.parametrize(
    "eng",
    [
        engine(ready=1),  # a replica still loading
        engine(updated=1),  # an old-template replica left
        engine(generation=4, observed=3),  # the Deployment controller has not seen the new spec
    ],
)
def test_rolling_out(eng: dict[str, Any]) -> None:
    progressing = by_type(rollout_conditions(NAME, eng, epp()))["Progressing"]
    assert (progressing.status, progressing.reason) == ("True", "RollingOut")


def test_a_new_deployment_without_observed_generation_is_not_rolling_out() -> None:
    progressing = by_type(rollout_conditions(NAME, engine(observed=None), epp()))["Progressing"]
    assert progressing.reason == "Complete"


def test_degraded_on_progress_deadline_or_replica_failure() -> None:
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "smol-1" has timed out progressing.',
    }
    conds = by_type(rollout_conditions(NAME, engine(ready=0, conditions=[deadline]), epp()))
    assert (conds["Degraded"].status, conds["Degraded"].reason) == ("True", "ProgressDeadlineExceeded")
    assert conds["Degraded"].message == deadline["message"]
    assert conds["Ready"].reason == "EngineNotReady"

    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}
    degraded = by_type(rollout_conditions(NAME, engine(conditions=[failure]), epp()))["Degraded"]
    assert (degraded.status, degraded.reason, degraded.message) == ("True", "ReplicaFailure", "quota")

    # A deployment still within its deadline is not degraded.
    fine = {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated", "message": ""}
    degraded = by_type(rollout_conditions(NAME, engine(conditions=[fine]), epp()))["Degraded"]
    assert degraded.status == "False"


def _accepted(status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "parentRef": {"name": "gw"},
        "conditions": [
            {
                "type": "Accepted",
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": "2026-12-02T00:00:00Z",
            }
        ],
    }


def test_gateway_accepted_reports_the_worst_gateway() -> None:
    assert gateway_accepted(pool())[0] == "Unknown"
    assert gateway_accepted(pool())[1].reason == "NoParents"
    assert gateway_accepted(pool([_accepted("True", "Accepted")]))[0] == "True"
    status, cond = gateway_accepted(
        pool([_accepted("True", "Accepted"), _accepted("False", "NotSupportedByGateway", "no EPP")])
    )
    assert (status, cond.reason, cond.message) == ("False", "NotSupportedByGateway", "2 gateway(s); no EPP")
    # A status the GIE schema would refuse is reported, not a crash.
    status, cond = gateway_accepted(pool([{"conditions": [{"type": "Accepted"}]}]))
    assert (status, cond.reason) == ("Unknown", "InvalidPoolStatus")
    assert "status.parents.0.parentRef" in cond.message


def _spec(**extra: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate({"model": {"source": "hf://org/smol"}, **extra})


def test_whole_report() -> None:
    spec = _spec(
        autoscaling={"backend": "keda", "metric": "queue-size"}, httpRoute={"parentRefs": [{"name": "gw"}]}
    )
    report = model_deployment_status(
        NAME, spec, ch.Capabilities(), engine(), epp(), pool([_accepted("True", "Accepted")])
    )
    assert [c.type for c in report.conditions] == [
        "Ready",
        "Progressing",
        "Degraded",
        "Autoscaling",
        "Routed",
        "GatewayAccepted",
    ]
    assert report.query == ch.autoscaler_query(NAME, "queue-size")
    assert report.fields == {
        "replicas": 2,
        "readyReplicas": 2,
        "endpoints": 2,
        "pool": NAME,
        "selector": "kvgate.dev/model-deployment=smol,kvgate.dev/role=engine",
        "gatewayAccepted": "True",
        "autoscaler": {"kind": "ScaledObject", "query": report.query},
    }
    assert report.events == []


def test_hpa_fallback_warns_once_and_gateway_api_missing() -> None:
    spec = _spec(autoscaling={"backend": "keda"}, httpRoute={"parentRefs": [{"name": "gw"}]})
    caps = ch.Capabilities(keda=False, gateway_api=False)
    report = model_deployment_status(NAME, spec, caps, engine(), epp(), pool())
    conds = by_type(report.conditions)
    assert conds["Autoscaling"].reason == "HPAFallback"
    assert conds["Routed"].reason == "GatewayAPIMissing"
    assert [e.reason for e in report.events] == ["HPAFallback"]
    assert report.fields["autoscaler"]["kind"] == "HorizontalPodAutoscaler"
    before = [{"type": "Autoscaling", "reason": "HPAFallback"}]
    again = model_deployment_status(NAME, spec, caps, engine(), epp(), pool(), old_conditions=before)
    assert again.events == []


def test_autoscaling_off() -> None:
    report = model_deployment_status(
        NAME, _spec(autoscaling={"backend": "off"}), ch.Capabilities(), engine(), epp(), pool()
    )
    assert by_type(report.conditions)["Autoscaling"].reason == "Disabled"
    assert "Routed" not in by_type(report.conditions)
    assert report.query is None and report.fields["autoscaler"] == {"kind": "none", "query": None}


def test_the_tenants_secret_missing_or_without_its_key_is_named() -> None:
    tenants = _spec(tenants={"secretName": "llm-tenants"}).tenants
    assert tenants is not None
    reason, msg = tenants_problem(tenants, None) or ("", "")
    assert reason == "TenantsSecretNotFound"
    assert "Secret llm-tenants (spec.tenants.secretName) does not exist" in msg
    reason, msg = tenants_problem(tenants, {"data": {"other.yaml": "eA=="}}) or ("", "")
    assert reason == "TenantsKeyNotFound"
    assert "no key 'tenants.yaml'" in msg and "its keys: other.yaml" in msg
    assert tenants_problem(tenants, {"data": {"tenants.yaml": "LSBuYW1lOiBh"}}) is None


def test_a_tenants_problem_degrades_and_warns_once() -> None:
    problem = ("TenantsSecretNotFound", "Secret t (spec.tenants.secretName) does not exist.")
    # A new picker, not ready: Ready says why, Degraded turns True, one Warning event.
    conds, events = degraded_by(rollout_conditions(NAME, engine(), epp(2, 0)), *problem, None)
    got = by_type(conds)
    assert (got["Degraded"].status, got["Degraded"].reason) == ("True", "TenantsSecretNotFound")
    assert got["Ready"].reason == "EndpointPickerNotReady" and problem[1] in got["Ready"].message
    assert [(e.type, e.reason) for e in events] == [("Warning", "TenantsSecretNotFound")]
    # The next pass, still missing: no second event.
    old = [{"type": c.type, "reason": c.reason, "message": c.message} for c in conds]
    assert degraded_by(rollout_conditions(NAME, engine(), epp(2, 0)), *problem, old)[1] == []
    # Pickers already serving (a rollout waits on the new one): Ready stays, Degraded says why.
    got = by_type(degraded_by(rollout_conditions(NAME, engine(), epp()), *problem, None)[0])
    assert got["Ready"].status == "True" and got["Degraded"].reason == "TenantsSecretNotFound"
    # Already degraded for another reason: that reason stays first, the message adds this one.
    deadline = [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "x"}
    ]
    got = by_type(
        degraded_by(rollout_conditions(NAME, engine(conditions=deadline), epp()), *problem, None)[0]
    )
    assert got["Degraded"].reason == "ProgressDeadlineExceeded"
    assert got["Degraded"].message == f"x Also: {problem[1]}"

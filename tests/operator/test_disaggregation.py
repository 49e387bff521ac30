"""Prefill/decode disaggregation in the operator (spec.disaggregation, issue 15): two engine
Deployments with role labels in one InferencePool, the picker with --pd-threshold, per-role
PDBs, autoscalers and NetworkPolicies, one shared KV-transfer Secret made once. Builders are
checked against the Kubernetes, KEDA and CRD schemas and the real CLIs' parsers; the real kopf
operator runs against kmock for the create / resync / switch-back / invalid paths."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvgate.api.contracts.disaggregation import ROLE_LABEL
from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.children import disaggregation as pd
from kvgate.operator.conditions import find
from kvgate.operator.config import OperatorConfig
from kvgate.operator.disaggregation_pass import combined_engine, disaggregated_status
from kvgate.operator.reconcile import SpecError, parse_spec, with_applied_annotation
from kvgate.operator.resources import (
    DEPLOYMENTS,
    HPAS,
    INFERENCE_POOLS,
    MODEL_DEPLOYMENTS,
    NETWORK_POLICIES,
    PDBS,
    SCALED_OBJECTS,
    SECRETS,
)

NS = "models"
UID = "6f1c2a9e-0000-4000-8000-00000000d15a"
SOURCE = {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smollm2"}
SPLIT = {
    "prefill": {"replicas": 1, "args": ["--max-num-batched-tokens", "4096"]},
    "decode": {"replicas": 2, "resources": {"limits": {"memory": "24Gi"}}},
    "threshold": 256,
}


def spec_of(**extra: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate({"model": SOURCE, "disaggregation": SPLIT, **extra})


def kids_by_key(kids: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(k["kind"], k["metadata"]["name"]): k for k in kids}


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


# ---------------------------------------------------------------------------------------------
# Pure builders
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"autoscaling": {"backend": "keda", "minReplicas": 2, "maxReplicas": 6}},
        {"autoscaling": {"backend": "hpa"}, "networkPolicy": {"enabled": False}},
        {"httpRoute": {"parentRefs": [{"name": "gw"}]}, "engine": {"accelerator": "none"}},
    ],
)
def test_children_are_valid_and_split_by_role(extra: dict[str, Any], validator: Any) -> None:
    spec = spec_of(**extra)
    owner = ch.model_deployment_owner("smol", NS, UID)
    for caps in (ch.Capabilities(), ch.Capabilities(keda=False, gateway_api=False)):
        kids = ch.model_deployment_children("smol", owner, spec, OperatorConfig(), caps)
        for kid in kids:
            validator.check(with_applied_annotation(kid))
        by = kids_by_key(kids)
        # No aggregated engines; both roles, each selecting only its own pods by the role label.
        assert ("Deployment", "smol") not in by and ("PodDisruptionBudget", "smol") not in by
        for role, kv_role in (("prefill", "producer"), ("decode", "consumer")):
            dep = by[("Deployment", f"smol-{role}")]
            selector = {"kvgate.dev/model-deployment": "smol", ROLE_LABEL: role}
            assert dep["spec"]["selector"] == {"matchLabels": selector}
            labels = dep["spec"]["template"]["metadata"]["labels"]
            assert labels[ROLE_LABEL] == role and labels["app.kubernetes.io/component"] == "engine"
            args = container(dep)["args"]
            assert args[args.index("--kv-role") + 1] == kv_role
            env = {e["name"]: e for e in container(dep)["env"]}
            assert env["KVGATE_KV_TRANSFER_SECRET"]["valueFrom"] == {
                "secretKeyRef": {"name": "smol-kv-transfer", "key": "secret"}
            }
            assert by[("PodDisruptionBudget", f"smol-{role}")]["spec"]["selector"] == {
                "matchLabels": selector
            }
        assert "--max-num-batched-tokens" in container(by[("Deployment", "smol-prefill")])["args"]
        assert "--max-num-batched-tokens" not in container(by[("Deployment", "smol-decode")])["args"]
        assert container(by[("Deployment", "smol-decode")])["resources"]["limits"]["memory"] == "24Gi"
        if "autoscaling" not in extra:
            assert by[("Deployment", "smol-prefill")]["spec"]["replicas"] == 1
            assert by[("Deployment", "smol-decode")]["spec"]["replicas"] == 2
        # One pool over both roles, never over the picker's pods.
        pool = by[("InferencePool", "smol")]
        assert pool["spec"]["selector"]["matchLabels"] == {
            "kvgate.dev/model-deployment": "smol",
            "app.kubernetes.io/component": "engine",
        }
        epp_labels = by[("Deployment", "smol-epp")]["spec"]["template"]["metadata"]["labels"]
        assert not all(epp_labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
        for role in ("prefill", "decode"):
            pod_labels = by[("Deployment", f"smol-{role}")]["spec"]["template"]["metadata"]["labels"]
            assert all(pod_labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
        epp_args = container(by[("Deployment", "smol-epp")])["args"]
        assert epp_args[epp_args.index("--pd-threshold") + 1] == "256"


def test_each_role_scales_on_its_own_queue(validator: Any) -> None:
    spec = spec_of(
        autoscaling={"backend": "keda", "minReplicas": 1, "maxReplicas": 4, "target": "3"},
        disaggregation={"prefill": {"minReplicas": 2, "maxReplicas": 8}, "decode": {}, "threshold": 0},
    )
    owner = ch.model_deployment_owner("smol", NS, UID)
    by = kids_by_key(ch.model_deployment_children("smol", owner, spec, OperatorConfig(), ch.Capabilities()))
    pre, dec = by[("ScaledObject", "smol-prefill")], by[("ScaledObject", "smol-decode")]
    assert pre["spec"]["scaleTargetRef"]["name"] == "smol-prefill"
    assert (pre["spec"]["minReplicaCount"], pre["spec"]["maxReplicaCount"]) == (2, 8)
    assert (dec["spec"]["minReplicaCount"], dec["spec"]["maxReplicaCount"]) == (1, 4)
    assert pre["spec"]["triggers"][0]["metadata"]["query"] == (
        'avg(max by (model_server_pod) (inference_pool_per_pod_queue_size{name="smol",'
        'model_server_pod=~"smol-prefill-.+"}))'
    )
    assert 'model_server_pod=~"smol-decode-.+"' in dec["spec"]["triggers"][0]["metadata"]["query"]
    # Unset role replicas: the autoscaler's floor at creation, then left to the autoscaler.
    assert by[("Deployment", "smol-prefill")]["spec"]["replicas"] == 2
    again = kids_by_key(
        ch.model_deployment_children(
            "smol", owner, spec, OperatorConfig(), ch.Capabilities(), existing_roles=frozenset({"prefill"})
        )
    )
    assert "replicas" not in again[("Deployment", "smol-prefill")]["spec"]
    assert again[("Deployment", "smol-decode")]["spec"]["replicas"] == 1
    # Without KEDA: an HPA per role on its own pods' queue.
    hpas = kids_by_key(
        ch.model_deployment_children("smol", owner, spec, OperatorConfig(), ch.Capabilities(keda=False))
    )
    hpa = hpas[("HorizontalPodAutoscaler", "smol-decode")]
    validator.check(hpa)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "smol-decode"
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm:num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "3"},
            },
        }
    ]


def test_the_queue_query_matches_only_the_roles_pods() -> None:
    import re

    pattern = re.search(r'model_server_pod=~"([^"]+)"', pd.role_queue_query("chat", "prefill"))
    assert pattern is not None
    rx = re.compile(pattern.group(1))
    assert rx.fullmatch("chat-prefill-7d9f8c6b5-x2k4q")
    assert not rx.fullmatch("chat-decode-7d9f8c6b5-x2k4q")
    assert not rx.fullmatch("chat-7d9f8c6b5-x2k4q")  # an aggregated engine of the same pool


def test_only_decode_engines_take_the_gateways_traffic() -> None:
    spec = spec_of()
    owner = ch.model_deployment_owner("smol", NS, UID)
    by = kids_by_key(ch.model_deployment_children("smol", owner, spec, OperatorConfig(), ch.Capabilities()))
    assert ("NetworkPolicy", "smol") not in by

    def peers(policy: dict[str, Any]) -> list[dict[str, Any]]:
        return [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]

    gateway = spec.network_policy.gateway_from[0].wire()
    decode, prefill = by[("NetworkPolicy", "smol-decode")], by[("NetworkPolicy", "smol-prefill")]
    assert gateway in peers(decode)
    assert gateway not in peers(prefill)
    assert prefill["spec"]["podSelector"]["matchLabels"][ROLE_LABEL] == "prefill"
    pulls = {"podSelector": {"matchLabels": {"kvgate.dev/model-deployment": "smol", ROLE_LABEL: "decode"}}}
    rule = next(r for r in prefill["spec"]["ingress"] if pulls in r["from"])
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    # The picker still scrapes and subscribes to both roles.
    epp = {"podSelector": {"matchLabels": {"kvgate.dev/model-deployment": "smol", ROLE_LABEL: "epp"}}}
    assert epp in peers(prefill) and epp in peers(decode)


def test_command_lines_parse_with_the_real_cli() -> None:
    from kvgate.cli import build_parser

    parser = build_parser()
    owner = ch.model_deployment_owner("smol", NS, UID)
    kids = ch.model_deployment_children("smol", owner, spec_of(), OperatorConfig(), ch.Capabilities())
    seen = {}
    for kid in kids:
        if kid["kind"] == "Deployment":
            c = container(kid)
            seen[kid["metadata"]["name"]] = parser.parse_args([*c["command"][1:], *c["args"]])
    assert seen["smol-prefill"].kv_role == "producer" and seen["smol-decode"].kv_role == "consumer"
    assert seen["smol-prefill"].max_num_batched_tokens == 4096
    assert seen["smol-epp"].pd_threshold == 256


def test_own_transfer_secret_in_engine_env_is_used_as_is() -> None:
    ref = {"secretKeyRef": {"name": "mine", "key": "k"}}
    spec = spec_of(engine={"env": [{"name": "KVGATE_KV_TRANSFER_SECRET", "valueFrom": ref}]})
    assert not pd.own_secret_wanted(spec)
    dep = pd.role_deployment(
        "smol", ch.model_deployment_owner("smol", NS, UID), spec, OperatorConfig(), "decode", 1
    )
    entries = [e for e in container(dep)["env"] if e["name"] == "KVGATE_KV_TRANSFER_SECRET"]
    assert entries == [{"name": "KVGATE_KV_TRANSFER_SECRET", "valueFrom": ref}]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"replicas": 2}, "replicas: not used with disaggregation"),
        (
            {"disaggregation": {"prefill": {"replicas": 0}}},
            "disaggregation.prefill.replicas: must be at least 1",
        ),
        (
            {"disaggregation": {"decode": {"replicas": 0}}},
            "disaggregation.decode.replicas: must be at least 1",
        ),
        ({"disaggregation": {"threshold": -1}}, "disaggregation.threshold"),
        (
            {"disaggregation": {"prefill": {"minReplicas": 5}}, "autoscaling": {"backend": "keda"}},
            "disaggregation.prefill: minReplicas 5 exceeds maxReplicas 4",
        ),
        (
            {"disaggregation": {"prefill": {"minReplicas": 0}}, "autoscaling": {"backend": "keda"}},
            "disaggregation.prefill: minReplicas must be at least 1",
        ),
        (
            {"disaggregation": {}, "autoscaling": {"backend": "hpa", "minReplicas": 0}},
            "disaggregation.decode: minReplicas must be at least 1",
        ),
        (
            {"disaggregation": {}, "autoscaling": {"backend": "keda", "metric": "saturation", "target": "1"}},
            "autoscaling.metric: saturation is pool-wide",
        ),
        (
            {"disaggregation": {}, "adapters": [{"name": "a", "source": "/a"}]},
            "not supported with disaggregation",
        ),
        (
            {"disaggregation": {}, "model": {"source": "/models/m.gguf"}},
            "routing.tokenizer: required with disaggregation",
        ),
    ],
)
def test_invalid_disaggregation_is_a_clear_spec_error(extra: dict[str, Any], message: str) -> None:
    raw = {"model": SOURCE, "disaggregation": SPLIT, **extra}
    with pytest.raises(SpecError, match=message):
        parse_spec("smol", raw)


def test_zero_replicas_are_fine_while_an_autoscaler_owns_the_count() -> None:
    parse_spec(
        "smol",
        {"model": SOURCE, "disaggregation": {"prefill": {"replicas": 0}}, "autoscaling": {"backend": "keda"}},
    )


def test_crd_schema_refuses_a_negative_threshold_and_admits_the_rest(validator: Any) -> None:
    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    validator.check({**base, "spec": {"model": SOURCE, "disaggregation": SPLIT}})
    validator.check({**base, "spec": {"model": SOURCE, "disaggregation": {}}})
    assert validator.errors({**base, "spec": {"model": SOURCE, "disaggregation": {"threshold": -1}}})
    assert validator.errors(
        {**base, "spec": {"model": SOURCE, "disaggregation": {"prefill": {"replicas": -1}}}}
    )
    assert validator.errors({**base, "spec": {"model": SOURCE, "disaggregation": {"bogus": 1}}})


def test_a_long_name_is_refused_with_disaggregation_only() -> None:
    name = "m" * 50
    with pytest.raises(SpecError, match="at most 49 characters with disaggregation"):
        parse_spec(name, {"model": SOURCE, "disaggregation": {}})
    parse_spec(name, {"model": SOURCE})
    parse_spec("m" * 49, {"model": SOURCE, "disaggregation": {}})


def _deployment(want: int, ready: int, rolled: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": want},
        "status": {
            "replicas": want,
            "readyReplicas": ready,
            "updatedReplicas": want,
            "observedGeneration": 2 if rolled else 1,
        },
    }


def _live(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, dict[str, Any]]:
    pool = ch.inference_pool("smol", ch.model_deployment_owner("smol", NS, UID), spec_of(), OperatorConfig())
    return {
        "Deployment/smol-prefill": prefill,
        "Deployment/smol-decode": decode,
        "Deployment/smol-epp": {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
        "InferencePool/smol": pool,
    }


def test_status_reads_both_roles() -> None:
    spec, caps = spec_of(), ch.Capabilities()
    report = disaggregated_status("smol", spec, caps, _live(_deployment(1, 1), _deployment(2, 2)), None)
    assert report.fields["readyReplicas"] == 3 and report.fields["replicas"] == 3
    assert report.fields["selector"] == "kvgate.dev/model-deployment=smol,app.kubernetes.io/component=engine"
    ready = find([c.__dict__ for c in report.conditions], "Ready")
    split = find([c.__dict__ for c in report.conditions], "Disaggregation")
    assert ready is not None and ready["status"] == "True"
    assert split is not None and split["reason"] == "Split"
    assert "prefill 1/1 ready" in split["message"] and "decode 2/2 ready" in split["message"]
    assert "more than 256 uncached tokens" in split["message"]

    # No decode engine ready: nothing can serve, whatever the prefill engines do.
    report = disaggregated_status("smol", spec, caps, _live(_deployment(1, 1), _deployment(2, 0)), None)
    ready = find([c.__dict__ for c in report.conditions], "Ready")
    assert ready is not None and ready["status"] == "False" and "0/2 decode engines ready" in ready["message"]

    # No prefill engine ready: serving, every prompt prefilled on the decode engines.
    report = disaggregated_status("smol", spec, caps, _live(_deployment(1, 0), _deployment(2, 2)), None)
    assert find([c.__dict__ for c in report.conditions], "Ready")["status"] == "True"  # type: ignore[index]
    split = find([c.__dict__ for c in report.conditions], "Disaggregation")
    assert split is not None and split["status"] == "False" and split["reason"] == "NoPrefillEngineReady"

    # One role still rolling out: Progressing.
    report = disaggregated_status(
        "smol", spec, caps, _live(_deployment(1, 1, rolled=False), _deployment(2, 2)), None
    )
    assert find([c.__dict__ for c in report.conditions], "Progressing")["reason"] == "RollingOut"  # type: ignore[index]


def test_a_failing_role_degrades_the_whole() -> None:
    stuck = _deployment(1, 0)
    stuck["status"]["conditions"] = [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "x"}
    ]
    combined = combined_engine([_deployment(2, 2), stuck])
    assert combined["spec"]["replicas"] == 3 and combined["status"]["readyReplicas"] == 2
    assert combined["status"]["conditions"][0]["reason"] == "ProgressDeadlineExceeded"


# ---------------------------------------------------------------------------------------------
# The real operator on kmock
# ---------------------------------------------------------------------------------------------


def md(spec_extra: dict[str, Any], name: str = "smol", uid: str = UID) -> dict[str, Any]:
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid},
        "spec": {"model": SOURCE, "engine": {"image": "ghcr.io/kvgate/engine:test"}, **spec_extra},
    }


def md_condition(cluster: Any, type_: str, name: str = "smol") -> dict[str, Any] | None:
    status = cluster.objects(MODEL_DEPLOYMENTS).get(name, {}).get("status") or {}
    return find(status.get("conditions"), type_)


async def test_operator_splits_keeps_the_secret_and_switches_back(
    cluster: Any, operator: Any, validator: Any
) -> None:
    await cluster.client.create(
        MODEL_DEPLOYMENTS, NS, md({"disaggregation": SPLIT, "autoscaling": {"backend": "keda"}})
    )
    want = {
        ("Deployment", "smol-prefill"),
        ("Deployment", "smol-decode"),
        ("PodDisruptionBudget", "smol-prefill"),
        ("PodDisruptionBudget", "smol-decode"),
        ("ScaledObject", "smol-prefill"),
        ("ScaledObject", "smol-decode"),
        ("NetworkPolicy", "smol-prefill"),
        ("NetworkPolicy", "smol-decode"),
        ("InferencePool", "smol"),
        ("Secret", "smol-kv-transfer"),
    }
    kids = await cluster.eventually(lambda: want <= set(cluster.children(UID)) and cluster.children(UID))
    assert ("Deployment", "smol") not in kids and ("NetworkPolicy", "smol") not in kids
    for (kind, _name), obj in kids.items():
        if kind != "Secret":  # its data is ours; the schema check is for what we apply
            validator.check(obj)
    secret = kids[("Secret", "smol-kv-transfer")]
    value = secret["data"]["secret"]
    assert len(base64.b64decode(value)) >= 32
    assert "kvgate.dev/applied" not in (secret["metadata"].get("annotations") or {})  # never copied out
    for role in ("prefill", "decode"):
        dep = kids[("Deployment", f"smol-{role}")]
        assert dep["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
        env = {e["name"]: e.get("valueFrom") for e in container(dep)["env"]}
        assert env["KVGATE_KV_TRANSFER_SECRET"]["secretKeyRef"]["name"] == "smol-kv-transfer"
    epp_args = container(kids[("Deployment", "smol-epp")])["args"]
    assert epp_args[epp_args.index("--pd-threshold") + 1] == "256"

    # Status from both roles once they are ready.
    for role, n in (("prefill", 1), ("decode", 2)):
        await cluster.client.patch(
            DEPLOYMENTS,
            NS,
            f"smol-{role}",
            {"status": {"replicas": n, "readyReplicas": n, "updatedReplicas": n}},
            "status",
        )
    await cluster.client.patch(
        DEPLOYMENTS, NS, "smol-epp", {"status": {"replicas": 2, "readyReplicas": 2}}, "status"
    )
    split = await cluster.eventually(
        lambda: (
            (md_condition(cluster, "Disaggregation") or {}).get("reason") == "Split"
            and md_condition(cluster, "Disaggregation")
        ),
        what="Disaggregation condition",
    )
    assert "prefill 1/1 ready" in split["message"] and "decode 2/2 ready" in split["message"]
    await cluster.eventually(
        lambda: (md_condition(cluster, "Ready") or {}).get("status") == "True", what="Ready=True"
    )
    status = cluster.objects(MODEL_DEPLOYMENTS)["smol"]["status"]
    assert status["readyReplicas"] == 3
    assert status["autoscaler"]["kind"] == "ScaledObject"

    # A spec change and several resyncs: the picker follows, the Secret never changes.
    split2 = {**SPLIT, "threshold": 1024}
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"disaggregation": split2}})

    def threshold() -> str:
        args = container(cluster.objects(DEPLOYMENTS)["smol-epp"])["args"]
        return str(args[args.index("--pd-threshold") + 1])

    await cluster.eventually(lambda: threshold() == "1024", 30, "new threshold")
    before = cluster.objects(SECRETS)["smol-kv-transfer"]
    passes = [
        r for r in cluster.emulator.requests() if r.resource and r.resource.plural == "modeldeployments"
    ]
    await cluster.eventually(
        lambda: (
            len(
                [
                    r
                    for r in cluster.emulator.requests()
                    if r.resource and r.resource.plural == "modeldeployments"
                ]
            )
            > len(passes) + 6
        ),
        what="several resync passes",
    )
    after = cluster.objects(SECRETS)["smol-kv-transfer"]
    assert after["data"] == before["data"] and after["data"]["secret"] == value
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    # Aggregated again: the role children go, the engine Deployment comes back; the Secret stays
    # (owned, so it goes with the ModelDeployment) for a later split.
    await cluster.client.patch(
        MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"disaggregation": None, "replicas": 1}}
    )
    await cluster.eventually(
        lambda: (
            "smol" in cluster.objects(DEPLOYMENTS)
            and not {"smol-prefill", "smol-decode"} & set(cluster.objects(DEPLOYMENTS))
        ),
        30,
        "aggregated engines only",
    )
    await cluster.eventually(
        lambda: (
            not {"smol-prefill", "smol-decode"}
            & (
                set(cluster.objects(PDBS))
                | set(cluster.objects(SCALED_OBJECTS))
                | set(cluster.objects(NETWORK_POLICIES))
            )
        ),
        30,
        "role PDBs, autoscalers and policies gone",
    )
    await cluster.eventually(
        lambda: "smol" in cluster.objects(PDBS) and "smol" in cluster.objects(NETWORK_POLICIES),
        30,
        "aggregated PDB and policy back",
    )
    assert not cluster.objects(HPAS)
    pool = cluster.objects(INFERENCE_POOLS)["smol"]
    assert pool["spec"]["selector"]["matchLabels"] == ch.engine_selector("smol")
    assert "--pd-threshold" not in container(cluster.objects(DEPLOYMENTS)["smol-epp"])["args"]
    assert cluster.objects(SECRETS)["smol-kv-transfer"]["data"]["secret"] == value

    # Split again: the aggregated engines go, and the kept Secret is reused as it is.
    await cluster.client.patch(
        MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"disaggregation": SPLIT, "replicas": None}}
    )
    await cluster.eventually(
        lambda: (
            {"smol-prefill", "smol-decode"} <= set(cluster.objects(DEPLOYMENTS))
            and "smol" not in cluster.objects(DEPLOYMENTS)
        ),
        30,
        "split again",
    )
    await cluster.eventually(lambda: "smol" not in cluster.objects(PDBS), 30, "aggregated PDB gone")
    assert cluster.objects(SECRETS)["smol-kv-transfer"]["data"]["secret"] == value


async def test_invalid_split_gets_a_condition_and_no_children(cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, md({"disaggregation": SPLIT, "replicas": 2}))
    cond = await cluster.eventually(lambda: md_condition(cluster, "Ready"), what="Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    assert "replicas: not used with disaggregation" in cond["message"]
    assert not cluster.children(UID) and not cluster.objects(SECRETS)


async def test_a_foreign_secret_of_that_name_is_never_taken_over(cluster: Any, operator: Any) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "smol-kv-transfer", "namespace": NS},
        "data": {"secret": base64.b64encode(b"theirs").decode()},
    }
    await cluster.client.create(SECRETS, NS, foreign)
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, md({"disaggregation": SPLIT}))
    cond = await cluster.eventually(
        lambda: (
            (md_condition(cluster, "Degraded") or {}).get("reason") == "ApplyFailed"
            and md_condition(cluster, "Degraded")
        ),
        what="ApplyFailed",
    )
    assert "Secret models/smol-kv-transfer exists and is not managed by kvgate" in cond["message"]
    assert cluster.objects(SECRETS)["smol-kv-transfer"]["data"]["secret"] == foreign["data"]["secret"]
    assert not any(k[0] == "Deployment" for k in cluster.children(UID))


def test_the_operators_rbac_can_make_the_transfer_secret() -> None:
    """The install manifest (generated from the chart) lets the operator create the Secret and
    refill it, and still not list or watch Secrets."""
    from pathlib import Path

    import yaml

    docs = yaml.safe_load_all(
        (Path(__file__).parents[2] / "manifests" / "install" / "operator.yaml").read_text()
    )
    rules = [r for d in docs if d and d["kind"] in ("ClusterRole", "Role") for r in d.get("rules", [])]
    verbs = {v for r in rules if "secrets" in r.get("resources", []) for v in r["verbs"]}
    assert {"get", "create", "patch"} <= verbs and not {"list", "watch"} & verbs


def _engines_service(*args: str, values: str | None = None, tmp: Any = None) -> tuple[int, Any]:
    import subprocess
    from pathlib import Path

    import yaml

    root = Path(__file__).parents[2]
    cmd = [str(root / ".tools" / "bin" / "helm"), "template", "kvgate", str(root / "charts" / "kvgate")]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(values)
        cmd += ["-f", str(path)]
    for item in args:
        cmd += ["--set", item]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return out.returncode, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return 0, {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"].endswith("-engines")
    }


def test_the_charts_gateway_sends_a_disaggregated_pool_only_to_decode_engines(
    tmp_path: Any, validator: Any
) -> None:
    """The chart's Envoy reaches engines through the headless <pool>-engines Service (its
    FailOpen and retry hosts): for a disaggregated pool it selects the decode engines only."""
    split = """
envoyGateway: {enabled: true, pool: chat}
models:
  - name: chat
    spec: {model: {source: "hf://Qwen/Qwen3-8B"}, disaggregation: {threshold: 512}}
"""
    rc, services = _engines_service(values=split, tmp=tmp_path)
    assert rc == 0, services
    svc = services["chat-engines"]
    validator.check(svc)
    decode = pd.role_selector("chat", "decode")
    assert svc["spec"]["selector"] == decode
    # The operator's decode pods carry exactly that; its prefill pods do not.
    spec = ModelDeploymentSpec.model_validate(
        {"model": {"source": "hf://Qwen/Qwen3-8B"}, "disaggregation": {}}
    )
    owner = ch.model_deployment_owner("chat", NS, UID)
    by = kids_by_key(ch.model_deployment_children("chat", owner, spec, OperatorConfig(), ch.Capabilities()))
    for role, selected in (("decode", True), ("prefill", False)):
        labels = by[("Deployment", f"chat-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()) is selected

    # An aggregated pool (or one the chart does not deploy) keeps the engine role; explicit wins.
    rc, services = _engines_service("envoyGateway.enabled=true", "envoyGateway.pool=smol")
    assert services["smol-engines"]["spec"]["selector"] == ch.engine_selector("smol")
    rc, services = _engines_service("envoyGateway.engineRole=engine", values=split, tmp=tmp_path)
    assert services["chat-engines"]["spec"]["selector"] == ch.engine_selector("chat")
    rc, services = _engines_service(
        "envoyGateway.enabled=true",
        "envoyGateway.pools[0].name=a",
        "envoyGateway.pools[1].name=b",
        "envoyGateway.pools[1].engineRole=decode",
    )
    assert services["a-engines"]["spec"]["selector"][ROLE_LABEL] == "engine"
    assert services["b-engines"]["spec"]["selector"][ROLE_LABEL] == "decode"
    rc, err = _engines_service(
        "envoyGateway.enabled=true", "envoyGateway.pool=x", "envoyGateway.engineRole=prefill"
    )
    assert rc != 0 and "engineRole" in err


def test_the_example_is_valid_and_splits(validator: Any) -> None:
    from pathlib import Path

    import yaml

    doc = yaml.safe_load(
        (
            Path(__file__).parents[2] / "manifests" / "examples" / "modeldeployment-disaggregated.yaml"
        ).read_text()
    )
    validator.check(doc)
    spec = parse_spec(doc["metadata"]["name"], doc["spec"])
    owner = ch.model_deployment_owner(doc["metadata"]["name"], NS, UID)
    by = kids_by_key(
        ch.model_deployment_children("qwen3-pd", owner, spec, OperatorConfig(), ch.Capabilities())
    )
    assert by[("Deployment", "qwen3-pd-prefill")]["spec"]["replicas"] == 1
    assert by[("Deployment", "qwen3-pd-decode")]["spec"]["replicas"] == 3

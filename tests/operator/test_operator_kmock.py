"""The real kopf operator against kmock's emulated API: children, updates, drift, deletion."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kvgate.operator.conditions import find
from kvgate.operator.resources import (
    CONFIG_MAPS,
    DEPLOYMENTS,
    EVENTS,
    HPAS,
    HTTP_ROUTES,
    INFERENCE_POOLS,
    MODEL_DEPLOYMENTS,
    NETWORK_POLICIES,
    PDBS,
    SCALED_OBJECTS,
    SECRETS,
    SERVICES,
)

NS = "models"  # the namespace the conftest operator watches
RESYNC_S = 0.4  # the conftest operator's resync interval
UID = "6f1c2a9e-0000-4000-8000-000000000001"

BASE_CHILDREN = {
    ("ServiceAccount", "smol-epp"),
    ("Role", "smol-epp"),
    ("RoleBinding", "smol-epp"),
    ("ConfigMap", "smol-epp"),
    ("Deployment", "smol-epp"),
    ("Service", "smol-epp"),
    ("PodDisruptionBudget", "smol-epp"),
    ("NetworkPolicy", "smol-epp"),
    ("InferencePool", "smol"),
    ("Deployment", "smol"),
    ("PodDisruptionBudget", "smol"),
    ("NetworkPolicy", "smol"),
}


def model_deployment(spec_extra: dict[str, Any] | None = None, name: str = "smol", uid: str = UID) -> dict:
    spec: dict[str, Any] = {
        "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smollm2"},
        "engine": {"image": "ghcr.io/kvgate/engine:test", "tensorParallelSize": 1},
    }
    spec.update(spec_extra or {})
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid},
        "spec": spec,
    }


def md_status(cluster: Any, name: str = "smol") -> dict[str, Any]:
    return cluster.objects(MODEL_DEPLOYMENTS).get(name, {}).get("status") or {}


def condition(cluster: Any, type_: str, name: str = "smol") -> dict[str, Any] | None:
    return find(md_status(cluster, name).get("conditions"), type_)


async def test_create_builds_exactly_the_children_then_status(cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"replicas": 2}))
    kids = await cluster.eventually(
        lambda: len(cluster.children(UID)) == len(BASE_CHILDREN) and cluster.children(UID)
    )
    assert set(kids) == BASE_CHILDREN
    for obj in kids.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "kvgate.dev/v1alpha1",
            "kind": "ModelDeployment",
            "name": "smol",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    engine = kids[("Deployment", "smol")]
    assert engine["spec"]["replicas"] == 2
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == [
        "--model",
        "/models/HuggingFaceTB--SmolLM2-135M-Instruct",
        "--served-model-name",
        "smollm2",
    ]
    pool = kids[("InferencePool", "smol")]
    assert pool["spec"]["endpointPickerRef"]["name"] == "smol-epp"
    assert "status" not in pool  # the gateway writes pool status, never the operator

    # Not ready yet: no pods exist in kmock.
    cond = await cluster.eventually(lambda: condition(cluster, "Ready"), what="Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "EngineNotReady"

    # Pretend the kubelet and the gateway did their part.
    await cluster.client.patch(
        DEPLOYMENTS,
        NS,
        "smol",
        {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
        "status",
    )
    await cluster.client.patch(
        DEPLOYMENTS, NS, "smol-epp", {"status": {"replicas": 1, "readyReplicas": 1}}, "status"
    )
    accepted = {
        "parents": [
            {
                "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"},
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": "True",
                        "reason": "Accepted",
                        "message": "ok",
                        "lastTransitionTime": "2026-12-02T00:00:00Z",
                    }
                ],
            }
        ]
    }
    await cluster.client.patch(INFERENCE_POOLS, NS, "smol", {"status": accepted}, "status")
    await cluster.eventually(
        lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready=True"
    )
    status = md_status(cluster)
    assert status["readyReplicas"] == 2 and status["endpoints"] == 2 and status["pool"] == "smol"
    await cluster.eventually(
        lambda: md_status(cluster).get("gatewayAccepted") == "True", what="gateway Accepted surfaced"
    )
    assert (condition(cluster, "GatewayAccepted") or {})["reason"] == "Accepted"
    # The operator never wrote the pool's status itself: it is exactly what the gateway wrote.
    assert cluster.objects(INFERENCE_POOLS)["smol"]["status"] == accepted


def engine_container(cluster: Any, name: str = "smol") -> dict[str, Any]:
    return cluster.objects(DEPLOYMENTS)[name]["spec"]["template"]["spec"]["containers"][0]


async def test_updates_replicas_image_and_switches_autoscaler(cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"replicas": 1}))
    await cluster.eventually(lambda: ("PodDisruptionBudget", "smol") in cluster.children(UID))

    await cluster.client.patch(
        MODEL_DEPLOYMENTS,
        NS,
        "smol",
        {"spec": {"replicas": 3, "engine": {"image": "ghcr.io/kvgate/engine:v2"}}},
    )
    await cluster.eventually(
        lambda: cluster.objects(DEPLOYMENTS)["smol"]["spec"]["replicas"] == 3, what="replicas 3"
    )
    await cluster.eventually(
        lambda: engine_container(cluster)["image"] == "ghcr.io/kvgate/engine:v2", what="image"
    )

    # off -> keda: a ScaledObject on the EPP's pool metric appears.
    await cluster.client.patch(
        MODEL_DEPLOYMENTS,
        NS,
        "smol",
        {
            "spec": {
                "replicas": None,
                "autoscaling": {"backend": "keda", "minReplicas": 1, "maxReplicas": 6, "target": "4"},
            }
        },
    )
    so = await cluster.eventually(lambda: cluster.objects(SCALED_OBJECTS).get("smol"), what="ScaledObject")
    # Handing the count to the autoscaler leaves the live count alone (a null would reset it to 1).
    assert cluster.objects(DEPLOYMENTS)["smol"]["spec"]["replicas"] == 3
    trigger = so["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
    assert 'inference_pool_average_queue_size{name="smol"}' in trigger["metadata"]["query"]
    assert so["spec"]["maxReplicaCount"] == 6
    cond = await cluster.eventually(
        lambda: (
            (condition(cluster, "Autoscaling") or {}).get("reason") == "KEDA"
            and condition(cluster, "Autoscaling")
        )
    )
    assert cond["status"] == "True"

    # KEDA adds its own label and finalizer and the HPA sets the live replica count; an update
    # of ours must keep all three.
    await cluster.client.patch(
        SCALED_OBJECTS,
        NS,
        "smol",
        {"metadata": {"labels": {"scaledobject.keda.sh/name": "smol"}, "finalizers": ["finalizer.keda.sh"]}},
    )
    await cluster.client.patch(DEPLOYMENTS, NS, "smol", {"spec": {"replicas": 5}})
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"autoscaling": {"maxReplicas": 8}}})
    await cluster.eventually(lambda: cluster.objects(SCALED_OBJECTS)["smol"]["spec"]["maxReplicaCount"] == 8)
    so = cluster.objects(SCALED_OBJECTS)["smol"]
    assert so["metadata"]["labels"]["scaledobject.keda.sh/name"] == "smol"
    assert so["metadata"]["finalizers"] == ["finalizer.keda.sh"]
    assert cluster.objects(DEPLOYMENTS)["smol"]["spec"]["replicas"] == 5  # the autoscaler's, kept

    # keda -> hpa: the ScaledObject goes, an autoscaling/v2 HPA comes.
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"autoscaling": {"backend": "hpa"}}})
    hpa = await cluster.eventually(lambda: cluster.objects(HPAS).get("smol"), what="HPA")
    assert hpa["spec"]["maxReplicas"] == 8
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "inference_pool_average_queue_size"
    # kmock keeps the ScaledObject pending on KEDA's finalizer, as a real API server would.
    await cluster.eventually(
        lambda: (
            "smol" not in cluster.objects(SCALED_OBJECTS)
            or cluster.objects(SCALED_OBJECTS)["smol"]["metadata"].get("deletionTimestamp")
        ),
        what="ScaledObject deleted",
    )
    # hpa -> off: the HPA goes; replicas fall back to 1.
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"autoscaling": {"backend": "off"}}})
    await cluster.eventually(lambda: "smol" not in cluster.objects(HPAS), what="HPA deleted")
    await cluster.eventually(lambda: cluster.objects(DEPLOYMENTS)["smol"]["spec"]["replicas"] == 1)
    kids = cluster.children(UID)
    assert set(kids) - BASE_CHILDREN <= {("ScaledObject", "smol")}  # only KEDA's pending one


async def test_hand_deleted_or_edited_children_are_restored(cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
    await cluster.eventually(lambda: set(cluster.children(UID)) == BASE_CHILDREN)
    original_args = engine_container(cluster)["args"]

    await cluster.client.delete(SERVICES, NS, "smol-epp")
    await cluster.client.delete(DEPLOYMENTS, NS, "smol")
    await cluster.client.patch(CONFIG_MAPS, NS, "smol-epp", {"data": {"epp-config.yaml": "tampered"}})
    await cluster.eventually(lambda: set(cluster.children(UID)) == BASE_CHILDREN, what="children recreated")
    await cluster.eventually(
        lambda: "prefix-cache-scorer" in cluster.objects(CONFIG_MAPS)["smol-epp"]["data"]["epp-config.yaml"],
        what="config repaired",
    )
    assert engine_container(cluster)["args"] == original_args


async def test_removed_fields_are_removed_from_children(cluster: Any, operator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"engine": {"drainSeconds": 20}}))
    await cluster.eventually(lambda: engine_container(cluster).get("lifecycle"))
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"engine": {"drainSeconds": 0}}})
    await cluster.eventually(lambda: "lifecycle" not in engine_container(cluster), what="preStop dropped")


def epp_deployment(cluster: Any, name: str = "smol") -> dict[str, Any]:
    return cluster.objects(DEPLOYMENTS)[f"{name}-epp"]


async def test_the_endpoint_picker_is_highly_available(cluster: Any, operator: Any, validator: Any) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
    kids = await cluster.eventually(
        lambda: set(cluster.children(UID)) == BASE_CHILDREN and cluster.children(UID)
    )
    for obj in kids.values():
        validator.check(obj)
    epp = kids[("Deployment", "smol-epp")]["spec"]
    assert epp["replicas"] == 2
    assert epp["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (term,) = epp["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": epp["selector"]["matchLabels"]},
    }
    probe = epp["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["grpc"] == {"port": 9003, "service": "readiness"}
    pdb = kids[("PodDisruptionBudget", "smol-epp")]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == epp["selector"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == UID

    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"routing": {"eppReplicas": 3}}})
    await cluster.eventually(lambda: epp_deployment(cluster)["spec"]["replicas"] == 3, what="3 pickers")

    # One Ready picker is enough to route; the Ready message says how many of how many.
    await cluster.client.patch(
        DEPLOYMENTS, NS, "smol", {"status": {"replicas": 1, "readyReplicas": 1}}, "status"
    )
    await cluster.client.patch(
        DEPLOYMENTS, NS, "smol-epp", {"status": {"replicas": 3, "readyReplicas": 1}}, "status"
    )
    cond = await cluster.eventually(
        lambda: (condition(cluster, "Ready") or {}).get("status") == "True" and condition(cluster, "Ready")
    )
    assert "1/3 endpoint pickers ready" in cond["message"]


async def test_network_policies_admit_only_the_gateway_the_picker_and_scrapers(
    cluster: Any, operator: Any, validator: Any
) -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}
    await cluster.client.create(
        MODEL_DEPLOYMENTS, NS, model_deployment({"networkPolicy": {"metricsFrom": [prometheus]}})
    )
    policies = await cluster.eventually(
        lambda: len(cluster.objects(NETWORK_POLICIES)) == 2 and cluster.objects(NETWORK_POLICIES)
    )
    for policy in policies.values():
        validator.check(policy)
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open
    gateway = [
        {
            "namespaceSelector": {"matchLabels": {}},
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "kvgate-envoy",
                    "app.kubernetes.io/component": "gateway",
                }
            },
        }
    ]

    def rules(policy: dict[str, Any]) -> list[tuple[Any, list[int]]]:
        return [(r["from"], [p["port"] for p in r["ports"]]) for r in policy["spec"]["ingress"]]

    epp = policies["smol-epp"]
    assert epp["spec"]["podSelector"] == epp_deployment(cluster)["spec"]["selector"]
    assert rules(epp) == [(gateway, [9002, 9003]), ([prometheus], [9090])]
    engine = policies["smol"]
    assert engine["spec"]["podSelector"] == cluster.objects(DEPLOYMENTS)["smol"]["spec"]["selector"]
    epp_pods = [{"podSelector": epp["spec"]["podSelector"]}]
    router = {
        "namespaceSelector": {"matchLabels": {}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate-model-router"}},
    }
    assert rules(engine) == [
        ([*gateway, router], [8000]),
        (epp_pods, [5557, 5558, 8000]),
        ([prometheus], [8000]),
    ]

    # Opting out removes them; the rest of the children stay.
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"networkPolicy": {"enabled": False}}})
    await cluster.eventually(lambda: not cluster.objects(NETWORK_POLICIES), what="policies removed")
    assert set(cluster.children(UID)) == {k for k in BASE_CHILDREN if k[0] != "NetworkPolicy"}
    assert cluster.objects(PDBS).keys() == {"smol", "smol-epp"}


async def test_tensor_parallelism_is_refused_with_a_condition(cluster: Any, operator: Any) -> None:
    bad = model_deployment({"engine": {"image": "ghcr.io/kvgate/engine:test", "tensorParallelSize": 2}})
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, bad)
    cond = await cluster.eventually(lambda: condition(cluster, "Ready"), what="Ready condition")
    assert cond["reason"] == "InvalidSpec"
    assert "tensorParallelSize 2 is not supported" in cond["message"]
    await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "InvalidSpec"],
        what="Warning event",
    )
    assert cluster.children(UID) == {}


async def test_an_invalid_kv_offload_size_is_refused_with_a_condition(cluster: Any, operator: Any) -> None:
    # The CRD's CEL rule refuses it on a real API server; the emulator admits it, so the
    # operator's own check shows: a condition and an event that say what to write instead.
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"kvOffload": {"size": "0Gi"}}))
    cond = await cluster.eventually(lambda: condition(cluster, "Ready"), what="Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    assert "spec.kvOffload.size" in cond["message"] and "above 0 with a unit" in cond["message"]
    await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "InvalidSpec"],
        what="Warning event",
    )
    assert cluster.children(UID) == {}


async def test_a_missing_tenants_secret_is_a_degraded_condition_until_it_exists(
    cluster: Any, operator: Any
) -> None:
    """spec.tenants names a Secret that is not there: the children are made (the picker pods
    wait on their mount), and Degraded plus a Warning event say which Secret; a Secret without
    the key says that; once the key is there the condition clears on the next pass (the resync:
    Secrets are not watched). test_status.py checks the event is posted once per problem."""
    await cluster.client.create(
        MODEL_DEPLOYMENTS, NS, model_deployment({"tenants": {"secretName": "llm-tenants"}})
    )
    # with tenants the engines get a key of their own, which only the picker sends
    await cluster.eventually(
        lambda: set(cluster.children(UID)) == BASE_CHILDREN | {("Secret", "smol-engine-key")}
    )
    pod = cluster.objects(DEPLOYMENTS)["smol-epp"]["spec"]["template"]["spec"]
    assert {"name": "tenants", "secret": {"secretName": "llm-tenants", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    assert "/etc/kvgate/tenants/tenants.yaml" in pod["containers"][0]["args"]
    key_ref = {"secretKeyRef": {"name": "smol-engine-key", "key": "api-key"}}
    engine = cluster.objects(DEPLOYMENTS)["smol"]["spec"]["template"]["spec"]["containers"][0]
    for container in (pod["containers"][0], engine):
        assert {"name": "KVGATE_API_KEY", "valueFrom": key_ref} in container["env"], container["env"]
    key = base64.b64decode(cluster.objects(SECRETS)["smol-engine-key"]["data"]["api-key"]).decode()
    assert len(key) >= 32

    def degraded(reason: str) -> dict[str, Any] | None:
        cond = condition(cluster, "Degraded") or {}
        return cond if cond.get("reason") == reason else None

    cond = await cluster.eventually(lambda: degraded("TenantsSecretNotFound"), what="TenantsSecretNotFound")
    assert cond["status"] == "True" and "Secret llm-tenants (spec.tenants.secretName)" in cond["message"]
    await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "TenantsSecretNotFound"],
        what="Warning event",
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "llm-tenants", "namespace": NS},
        "data": {"other.yaml": "LSBbXQ=="},
    }
    await cluster.client.create(SECRETS, NS, secret)
    cond = await cluster.eventually(lambda: degraded("TenantsKeyNotFound"), what="TenantsKeyNotFound")
    assert "no key 'tenants.yaml'" in cond["message"]
    await cluster.client.patch(SECRETS, NS, "llm-tenants", {"data": {"tenants.yaml": "LSBbXQ=="}})
    cond = await cluster.eventually(lambda: degraded("AsExpected"), what="Degraded cleared")
    assert cond["status"] == "False"
    # made once: the passes since kept its value
    assert base64.b64decode(cluster.objects(SECRETS)["smol-engine-key"]["data"]["api-key"]).decode() == key


async def test_invalid_spec_gets_a_condition_an_event_and_no_children(cluster: Any, operator: Any) -> None:
    bad = model_deployment(
        {
            "model": {"source": "s3://bucket/model"},
            "autoscaling": {"backend": "keda", "minReplicas": 5, "maxReplicas": 2},
        }
    )
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, bad)
    cond = await cluster.eventually(lambda: condition(cluster, "Ready"), what="Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    assert (
        "spec.model.source" in cond["message"]
        and "minReplicas must not exceed maxReplicas" in cond["message"]
    )
    assert (condition(cluster, "Degraded") or {})["status"] == "True"
    events = await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "InvalidSpec"],
        what="event",
    )
    assert events[0]["type"] == "Warning"
    assert cluster.children(UID) == {}


async def test_deletion_leaves_children_to_garbage_collection(cluster: Any, operator: Any) -> None:
    # A second deployment stays: its resync passes (each reads it back first) show the
    # operator's timers running, so "nothing recreated" is checked after passes, not a sleep.
    other_uid = "6f1c2a9e-0000-4000-8000-0000000000a2"
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment(name="other", uid=other_uid))
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
    await cluster.eventually(lambda: set(cluster.children(UID)) == BASE_CHILDREN)
    await cluster.eventually(lambda: cluster.objects(MODEL_DEPLOYMENTS)["smol"]["metadata"].get("finalizers"))
    await cluster.client.delete(MODEL_DEPLOYMENTS, NS, "smol")
    await cluster.eventually(
        lambda: "smol" not in cluster.objects(MODEL_DEPLOYMENTS), what="finalizer released"
    )
    assert await cluster.collect_garbage() == len(BASE_CHILDREN)

    def reads_of_other() -> int:
        return sum(
            1
            for r in cluster.emulator.requests()
            if r.method == "GET"
            and r.name == "other"
            and r.resource
            and r.resource.plural == "modeldeployments"
        )

    after_gc = reads_of_other()
    # three more passes over the survivor: a stale timer or handler of the deleted one had its turns
    await cluster.eventually(lambda: reads_of_other() >= after_gc + 3, within=30, what="three resync passes")
    assert cluster.children(UID) == {}
    assert set(cluster.children(other_uid)) == {
        (kind, name.replace("smol", "other")) for kind, name in BASE_CHILDREN
    }


async def test_hand_made_pool_with_managed_annotation_gets_an_epp(cluster: Any, operator: Any) -> None:
    pool_uid = "6f1c2a9e-0000-4000-8000-00000000000f"
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "vllm-llama3",
            "namespace": NS,
            "uid": pool_uid,
            "annotations": {"kvgate.dev/epp": "managed", "kvgate.dev/tokenizer": "meta-llama/Llama-3.1-8B"},
        },
        "spec": {"selector": {"matchLabels": {"app": "vllm-llama3"}}, "targetPorts": [{"number": 8000}]},
    }
    await cluster.client.create(INFERENCE_POOLS, NS, pool)
    kids = await cluster.eventually(
        lambda: len(cluster.children(pool_uid)) == 7 and cluster.children(pool_uid)
    )
    assert {kind for kind, _ in kids} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }
    # The pool's model servers are not ours, so no NetworkPolicy; the picker is still HA.
    assert kids[("Deployment", "vllm-llama3-epp")]["spec"]["replicas"] == 2
    assert {name for _, name in kids} == {"vllm-llama3-epp"}
    args = kids[("Deployment", "vllm-llama3-epp")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--pool-name", "vllm-llama3", "--pool-namespace", NS]
    assert args[-2:] == ["--tokenizer", "meta-llama/Llama-3.1-8B"]
    ref = await cluster.eventually(
        lambda: cluster.objects(INFERENCE_POOLS)["vllm-llama3"]["spec"].get("endpointPickerRef")
    )
    assert ref == {
        "group": "",
        "kind": "Service",
        "name": "vllm-llama3-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # A pool without the annotation is left alone. Seen, not waited for: a managed pool created
    # after it comes through the same watch, so once that one has its picker, the operator has
    # passed over the plain one; and annotating the plain one then gives it one too.
    plain = copy.deepcopy(pool)
    plain["metadata"].update(name="other", uid="6f1c2a9e-0000-4000-8000-0000000000aa", annotations={})
    await cluster.client.create(INFERENCE_POOLS, NS, plain)
    probe = copy.deepcopy(pool)
    probe["metadata"].update(name="probe", uid="6f1c2a9e-0000-4000-8000-0000000000ab")
    await cluster.client.create(INFERENCE_POOLS, NS, probe)
    await cluster.eventually(
        lambda: cluster.children("6f1c2a9e-0000-4000-8000-0000000000ab"), what="probe's EPP"
    )
    assert cluster.children("6f1c2a9e-0000-4000-8000-0000000000aa") == {}
    await cluster.client.patch(
        INFERENCE_POOLS, NS, "other", {"metadata": {"annotations": pool["metadata"]["annotations"]}}
    )
    await cluster.eventually(
        lambda: cluster.children("6f1c2a9e-0000-4000-8000-0000000000aa"), what="the EPP once annotated"
    )


async def test_managed_pool_is_read_with_the_gie_model(cluster: Any, operator: Any) -> None:
    # The API server would refuse this pool (GIE's schema): kmock stores it, and the operator
    # reads pools with the same models the CRD is generated from, so it says why and builds nothing.
    pool_uid = "6f1c2a9e-0000-4000-8000-0000000000bb"
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "broken",
            "namespace": NS,
            "uid": pool_uid,
            "annotations": {"kvgate.dev/epp": "managed"},
        },
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []},
    }
    await cluster.client.create(INFERENCE_POOLS, NS, pool)
    events = await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "InvalidPool"],
        what="InvalidPool event",
    )
    assert events[0]["type"] == "Warning"
    assert "spec.targetPorts" in events[0]["message"]
    assert cluster.children(pool_uid) == {}


@pytest.mark.parametrize("keda", [False])
async def test_without_keda_an_hpa_stands_in_with_a_condition(
    cluster: Any, operator: Any, keda: bool
) -> None:
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"autoscaling": {"backend": "keda"}}))
    hpa = await cluster.eventually(lambda: cluster.objects(HPAS).get("smol"), what="HPA fallback")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smol"}
    cond = await cluster.eventually(lambda: condition(cluster, "Autoscaling"))
    assert cond["reason"] == "HPAFallback" and "KEDA" in cond["message"]
    events = await cluster.eventually(
        lambda: [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "HPAFallback"],
        what="event",
    )
    assert events[0]["type"] == "Warning"
    assert ("ScaledObject", "smol") not in cluster.children(UID)
    # Unset replicas with an autoscaler: created at minReplicas, then left to the HPA.
    assert cluster.objects(DEPLOYMENTS)["smol"]["spec"]["replicas"] == 1


async def test_http_route_points_at_the_pool(cluster: Any, operator: Any) -> None:
    route = {"parentRefs": [{"name": "inference-gateway"}], "hostnames": ["llm.example.com"]}
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"httpRoute": route}))
    obj = await cluster.eventually(lambda: cluster.objects(HTTP_ROUTES).get("smol"), what="HTTPRoute")
    assert obj["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smol"}
    ]
    assert obj["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"httpRoute": None}})
    await cluster.eventually(lambda: "smol" not in cluster.objects(HTTP_ROUTES), what="HTTPRoute deleted")


@pytest.mark.parametrize("gateway_api", [False])
async def test_without_gateway_api_no_route_and_a_condition(
    cluster: Any, operator: Any, gateway_api: bool
) -> None:
    route = {"parentRefs": [{"name": "inference-gateway"}]}
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment({"httpRoute": route}))
    cond = await cluster.eventually(lambda: condition(cluster, "Routed"), what="Routed condition")
    assert cond["status"] == "False" and cond["reason"] == "GatewayAPIMissing"
    assert set(cluster.children(UID)) == BASE_CHILDREN  # everything else is there


async def test_an_existing_object_of_the_same_name_is_never_taken_over(cluster: Any, operator: Any) -> None:
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "smol-epp", "namespace": NS},
               "data": {"epp-config.yaml": "someone else's"}}  # fmt: skip
    await cluster.client.create(CONFIG_MAPS, NS, foreign)
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
    cond = await cluster.eventually(lambda: condition(cluster, "Degraded"), what="Degraded condition")
    assert cond["status"] == "True" and cond["reason"] == "ApplyFailed"
    assert "ConfigMap models/smol-epp exist(s) and is not managed by kvgate" in cond["message"]
    assert cluster.children(UID) == {}  # nothing half-created
    assert cluster.objects(CONFIG_MAPS)["smol-epp"]["data"] == {"epp-config.yaml": "someone else's"}
    assert "ownerReferences" not in cluster.objects(CONFIG_MAPS)["smol-epp"]["metadata"]


@pytest.mark.parametrize("resync", [30.0])
async def test_child_events_refresh_without_waiting_for_resync(
    cluster: Any, resync: float, operator_config: Any
) -> None:
    """With a 30 s resync, a deleted child and a child's new status still land at once: the
    operator watches its Deployments and pools."""
    import dataclasses

    from kvgate.operator.handlers import Operator

    config = dataclasses.replace(operator_config, resync_seconds=resync)
    op = Operator(config, login=lambda **_: kopf.ConnectionInfo(server=cluster.url))
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(op.run(stop_flag=stop, ready_flag=ready)), daemon=True
    )
    thread.start()
    await asyncio.to_thread(ready.wait, 10)
    await cluster.watched("modeldeployments", "inferencepools", "deployments")
    try:
        await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
        await cluster.eventually(lambda: set(cluster.children(UID)) == BASE_CHILDREN, what="children")
        await cluster.client.delete(DEPLOYMENTS, NS, "smol")
        await cluster.eventually(
            lambda: "smol" in cluster.objects(DEPLOYMENTS), within=5, what="engine recreated"
        )
        await cluster.client.patch(
            DEPLOYMENTS,
            NS,
            "smol",
            {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
            "status",
        )
        await cluster.client.patch(
            DEPLOYMENTS, NS, "smol-epp", {"status": {"replicas": 1, "readyReplicas": 1}}, "status"
        )
        await cluster.eventually(
            lambda: (condition(cluster, "Ready") or {}).get("status") == "True",
            within=5,
            what="Ready from events",
        )
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)


async def test_cli_runs_the_operator_from_a_kubeconfig(cluster: Any, tmp_path: Any) -> None:
    """`kvgate operator run` as its own process: kubeconfig login, liveness, reconcile, SIGTERM."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                "users": [{"name": "dev", "user": {"token": "dev-token"}}],
                "contexts": [
                    {"name": "kmock", "context": {"cluster": "kmock", "user": "dev", "namespace": NS}}
                ],
                "current-context": "kmock",
            }
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        str(Path(sys.executable).parent / "kvgate"), "operator", "run", "--namespace", NS, "--no-scanning",
        "--resync-seconds", "0.5", "--liveness-port", str(port), "--log-format", "json",
    ]  # fmt: skip
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=out
        )
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        await cluster.eventually(lambda: asyncio.to_thread(healthy), within=30, what="liveness endpoint")
        await cluster.watched("modeldeployments", "inferencepools", "deployments")
        await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment())
        await cluster.eventually(
            lambda: set(cluster.children(UID)) == BASE_CHILDREN, within=20, what="children"
        )
        requests = [r for r in cluster.emulator.requests() if r.headers.get("Authorization")]
        assert requests and all(r.headers["Authorization"] == "Bearer dev-token" for r in requests)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0, log.read_text()[-2000:]
    # --log-format json: every line the operator wrote is one JSON record, kvgate's own among them
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any(r["logger"].startswith("kvgate.operator") for r in records), records


def test_cli_without_credentials_is_a_clear_error(tmp_path: Any) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": ""}
    kvgate = str(Path(sys.executable).parent / "kvgate")
    out = subprocess.run([kvgate, "operator", "run"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no Kubernetes credentials" in out.stderr and "Traceback" not in out.stderr
    bad = subprocess.run(
        [kvgate, "operator", "run", "--prometheus-url", "nope"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--prometheus-url must be an http(s) URL" in bad.stderr

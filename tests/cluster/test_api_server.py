"""kvgate's Kubernetes half against a real kube-apiserver (scripts/cluster.sh): the CRDs are
accepted and served, GIE v1 objects validate against them and invalid ones are refused with the
schema's own message, `kubectl get` prints the printer columns, and the chart installs,
upgrades and uninstalls cleanly with Pod Security admission enforcing `restricted`.

The operator and the EPP at work on the node, with traffic, edits and faults: test_workloads.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.testing.polling import eventually

from .conftest import CRDS, Cluster

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "operator" / "data"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_api_server_is_the_pinned_release_with_rbac_on(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"] == "v1.37.2" and (version["major"], version["minor"]) == ("1", "37")
    # RBAC is enforced: an unbound ServiceAccount may not even list pods
    cluster.kubectl("create", "serviceaccount", "nobody")
    denied = cluster.kubectl(
        "auth", "can-i", "list", "pods", "--as", "system:serviceaccount:default:nobody", check=False
    )
    assert denied.stdout.strip() == "no"


def test_the_crds_are_established_with_no_warnings(crds: Cluster) -> None:
    for name in CRDS:
        crd = crds.get("crd", name)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", (name, conditions)
        assert conditions.get("NonStructuralSchema") != "True", (name, conditions)


def test_gie_v1_inference_pools_are_accepted(crds: Cluster) -> None:
    docs = _docs(DATA / "gie_inferencepools.yaml")
    assert len(docs) >= 3
    for doc in docs:
        ns = doc["metadata"].get("namespace", "default")
        crds.kubectl("create", "namespace", ns, check=False)  # the conformance suite's namespaces
        done = crds.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
        assert "Warning" not in done.stderr, done.stderr
        got = crds.get("inferencepool", doc["metadata"]["name"], "-n", ns)
        assert got["spec"]["targetPorts"] == doc["spec"]["targetPorts"]


def test_invalid_inference_pools_are_refused_by_the_api_server_with_the_schemas_message(
    crds: Cluster,
) -> None:
    for doc in _docs(DATA / "invalid_inferencepools.yaml"):
        reason = doc.pop("x-reason")
        done = crds.kubectl("create", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False)
        assert done.returncode != 0, f"the API server accepted an invalid pool: {reason}"
        assert "is invalid" in done.stderr and "Traceback" not in done.stderr, (reason, done.stderr)


def test_inference_objectives_and_model_deployments_from_the_examples_are_accepted(crds: Cluster) -> None:
    for name in ("inferenceobjective.yaml", "modeldeployment-smollm2.yaml", "modeldeployment-disaggregated.yaml",
                 "inferencepool-managed-epp.yaml"):  # fmt: skip
        for doc in _docs(ROOT / "manifests" / "examples" / name):
            done = crds.kubectl(
                "create", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False
            )
            assert done.returncode == 0, (name, done.stderr)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"model": {"source": "s3://bucket/model"}}, "spec.model.source"),
        ({"model": {"source": "hf://org/model"}, "replicas": -1}, "spec.replicas"),
        ({"model": {"source": "hf://org/model"}, "routing": {"failureMode": "Maybe"}}, "failureMode"),
        ({"model": {"source": "hf://" + "x" * 100_000}}, "spec.model.source"),
        (
            {
                "model": {"source": "hf://org/model"},
                "adapters": [{"name": f"a{i}", "source": f"hf://org/a{i}"} for i in range(10_000)],
            },
            "spec.adapters",
        ),
        (
            {
                "model": {"source": "hf://org/model"},
                "routing": {"failureMode": "FailOpen"},
                "tenants": {"secretName": "tenants"},
            },
            "spec.tenants with spec.routing.failureMode FailOpen",
        ),
    ],
    ids=[
        "s3-source",
        "negative-replicas",
        "failure-mode",
        "huge-source",
        "10000-adapters",
        "tenants-fail-open",
    ],
)
def test_invalid_model_deployments_are_refused_with_the_field_named(
    crds: Cluster, spec: dict[str, Any], words: str
) -> None:
    doc = {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    done = crds.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(doc), check=False)
    assert done.returncode != 0 and words in done.stderr, done.stderr[-2000:]


def test_tenants_with_the_default_failure_mode_are_accepted(crds: Cluster) -> None:
    doc = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "keyed"},
           "spec": {"model": {"source": "hf://org/model"}, "tenants": {"secretName": "tenants"}}}  # fmt: skip
    done = crds.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(doc), check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_invalid_name_is_refused_with_the_rule(crds: Cluster) -> None:
    doc = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "Bad_Name"},
           "spec": {"model": {"source": "hf://org/model"}}}  # fmt: skip
    done = crds.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(doc), check=False)
    assert done.returncode != 0 and "RFC 1123" in done.stderr, done.stderr[-2000:]


def test_kubectl_get_prints_the_printer_columns(crds: Cluster) -> None:
    pool = _docs(DATA / "gie_inferencepools.yaml")[0]
    pool["metadata"].pop("namespace", None)
    crds.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pool))
    header = crds.kubectl("get", "inferencepools").stdout.splitlines()[0].split()
    assert header[0] == "NAME" and "PORT" in header and "EPP" in header, header
    wide = crds.kubectl("get", "inferencepools", "-o", "wide").stdout.splitlines()[0]
    assert "SELECTOR" in wide, wide
    assert crds.kubectl("get", "modeldeployments").returncode == 0


NS = "kvgate-system"


@pytest.fixture(scope="module")
def installed(crds: Cluster) -> Iterator[Cluster]:
    """The chart installed as a user would, into a namespace that enforces `restricted`. Its
    operator pod runs on the node and watches only its own namespace here: these tests write
    ModelDeployments and their children themselves (test_workloads.py has the operator at work)."""
    crds.kubectl("create", "namespace", NS)
    crds.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted")
    crds.helm(
        "install", "kvgate", "charts/kvgate", "--namespace", NS, "--set", f"operator.watchNamespaces={{{NS}}}"
    )
    yield crds
    crds.helm("uninstall", "kvgate", "--namespace", NS, "--wait", check=False)  # if a test failed first


def test_the_chart_installs_and_its_pods_pass_restricted_pod_security(installed: Cluster) -> None:
    deployments = installed.get("deployments", "-n", NS)["items"]
    assert deployments, "the chart created no Deployment"

    def refusals() -> list[str]:
        events = installed.get("events", "-n", NS)["items"]
        return [e["message"] for e in events if e.get("reason") == "FailedCreate"]

    def pods_created() -> bool:
        # the ReplicaSet controller made them, so Pod Security admission let the template in
        # (the node then runs them)
        return len(installed.get("pods", "-n", NS)["items"]) >= len(deployments)

    eventually(lambda: pods_created() or refusals(), 90, "the chart's pods created, or refused")
    assert not refusals(), refusals()


@pytest.mark.parametrize("spec_name", ["minimal", "hpa-routing", "lora-adapters", "gguf-cpu"])
def test_the_operators_service_account_may_write_every_child(installed: Cluster, spec_name: str) -> None:
    """What the operator writes for a ModelDeployment, created by the chart's own ServiceAccount
    (impersonated): authorization, RBAC's escalation check on the Role and RoleBinding it grants
    the EPP, admission (Pod Security) and schema all run as they would for the operator."""
    from kvgate.api.k8s.crds import ModelDeploymentSpec
    from kvgate.operator import children as ch
    from kvgate.operator.config import OperatorConfig
    from kvgate.operator.reconcile import with_applied_annotation

    specs = {
        "minimal": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}},
        "hpa-routing": {
            "model": {"source": "hf://org/model"},
            "autoscaling": {"backend": "hpa", "metric": "kv-cache-utilization", "target": "0.8"},
            "routing": {"failureMode": "FailOpen"},
        },
        "lora-adapters": {
            "model": {"source": "pvc://models/llama-3-8b", "servedName": "llama"},
            "lora": {"maxLoras": 2, "maxLoraRank": 32, "claims": ["loras"]},
            "adapters": [{"name": "sql", "source": "hf://acme/sql-lora@v2", "rank": 16}],
        },
        "gguf-cpu": {"model": {"source": "/models/m.gguf"}, "engine": {"accelerator": "none"}, "replicas": 3},
    }
    sa = installed.get("serviceaccounts", "-n", NS)["items"]
    name = next(a["metadata"]["name"] for a in sa if a["metadata"]["name"] != "default")
    who = f"system:serviceaccount:{NS}:{name}"
    spec = ModelDeploymentSpec.model_validate(specs[spec_name])
    installed.kubectl("create", "namespace", "models", check=False)
    md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment",
          "metadata": {"name": spec_name, "namespace": "models"}, "spec": specs[spec_name]}  # fmt: skip
    installed.kubectl("create", "-f", "-", stdin=json.dumps(md))
    uid = installed.get("modeldeployment", spec_name, "-n", "models")["metadata"]["uid"]
    owner = ch.model_deployment_owner(spec_name, "models", uid)
    caps = ch.Capabilities(keda=False, gateway_api=False)  # those CRDs are not installed here
    kids = ch.model_deployment_children(spec_name, owner, spec, OperatorConfig(), caps)
    if not any(k["kind"] == "HorizontalPodAutoscaler" for k in kids):  # the one an hpa spec gets
        kids.append(ch.horizontal_pod_autoscaler(spec_name, owner, spec.autoscaling, OperatorConfig()))
    refused = []
    # a RoleBinding's escalation check reads the Role it names: the Role goes first
    for kid in sorted(kids, key=lambda k: k["kind"] != "Role"):
        body = json.dumps(with_applied_annotation(kid))
        done = installed.kubectl("create", "--as", who, "-f", "-", stdin=body, check=False)
        if done.returncode != 0:
            refused.append(f"{kid['kind']} {kid['metadata']['name']}: {done.stderr.strip()[-400:]}")
    assert not refused, "\n".join(refused)
    # The owner references are ones the garbage collector resolves: the children outlive a GC
    # pass while their ModelDeployment exists, and go with it.
    kinds = sorted({k["kind"].lower() for k in kids})
    selector = f"kvgate.dev/model-deployment={spec_name}"

    def children() -> int:
        return len(installed.get(",".join(kinds), "-n", "models", "-l", selector)["items"])

    created = children()
    assert created >= len(kids) - 1, (created, len(kids))
    # A pass of the garbage collector, seen rather than waited for: a ConfigMap whose owner does
    # not exist is collected by it; once it is gone, the live owner's children must still be there.
    ghost = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{spec_name}-orphan", "namespace": "models",
                          "ownerReferences": [{"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment",
                                               "name": "ghost", "uid": "00000000-0000-4000-8000-00000000dead"}]}}  # fmt: skip
    installed.kubectl("create", "-f", "-", stdin=json.dumps(ghost))
    eventually(
        lambda: not installed.get("configmaps", "-n", "models", "--field-selector",
                                  f"metadata.name={spec_name}-orphan")["items"],
        90, "the garbage collector collecting an orphan",
    )  # fmt: skip
    assert children() == created, "the garbage collector took children of a live owner"
    installed.delete("modeldeployment", spec_name, "models", 90)
    eventually(lambda: children() == 0, 90, "every child garbage-collected")
    for verb, resource in [("watch", "modeldeployments.kvgate.dev"), ("patch", "modeldeployments.kvgate.dev/status"),
                           ("list", "pods"), ("create", "events"), ("patch", "deployments.apps")]:  # fmt: skip
        can = installed.kubectl("auth", "can-i", verb, resource, "-n", "models", "--as", who, check=False)
        assert can.stdout.strip() == "yes", (verb, resource, can.stdout, can.stderr)


def test_the_operator_under_the_charts_service_account_reconciles_and_deletes(
    installed: Cluster, tmp_path: Path
) -> None:
    """`kvgate operator run` as the chart runs it, logged in with a token the API server issued
    for the chart's ServiceAccount (TokenRequest): no permission beyond the chart's ClusterRole."""
    sa = installed.get("serviceaccounts", "-n", NS)["items"]
    name = next(a["metadata"]["name"] for a in sa if a["metadata"]["name"] != "default")
    token = installed.kubectl("create", "token", name, "-n", NS, "--duration", "1h").stdout.strip()
    admin = yaml.safe_load(installed.kubeconfig.read_text())
    admin["users"] = [{"name": "user", "user": {"token": token}}]
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(admin))
    log = tmp_path / "operator.log"
    kvgate = Path(sys.executable).parent / "kvgate"
    argv = [str(kvgate), "operator", "run", "--all-namespaces", "--resync-seconds=2", "--liveness-port=0"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=out
        )
    ns, md_name = "ops", "chat"
    try:
        installed.kubectl("create", "namespace", ns, check=False)
        md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment",
              "metadata": {"name": md_name, "namespace": ns},
              "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "replicas": 2}}  # fmt: skip
        installed.kubectl("apply", "-f", "-", stdin=json.dumps(md))
        selector = f"kvgate.dev/model-deployment={md_name}"
        kinds = "deployments,services,serviceaccounts,configmaps,roles,rolebindings,poddisruptionbudgets,networkpolicies,inferencepools"

        def children() -> dict[str, int]:
            items = installed.get(kinds, "-n", ns, "-l", selector)["items"]
            counts: dict[str, int] = {}
            for item in items:
                counts[item["kind"]] = counts.get(item["kind"], 0) + 1
            return counts

        def reconciled() -> dict[str, int] | None:
            got = children()
            wanted = {"Deployment", "Service", "InferencePool", "Role", "RoleBinding", "ServiceAccount",
                      "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"}  # fmt: skip
            # every kind, and both Deployments (the engines' and the EPP's): the operator writes
            # them one after another, so seeing every kind can come before the second one
            return got if wanted <= set(got) and got["Deployment"] >= 2 else None

        got = eventually(reconciled, 90, "the operator's children")
        assert got["Deployment"] >= 2, got  # the engines and the EPP

        def conditions() -> dict[str, str]:
            status = installed.get("modeldeployment", md_name, "-n", ns).get("status") or {}
            return {c["type"]: c["status"] for c in status.get("conditions", [])}

        # a Hub model, and the node lets nothing leave loopback: the engines stay in their init
        # container and never become Ready, and the status says so
        assert "Ready" in eventually(conditions, 60, "status conditions")
        engine = installed.get("deployment", md_name, "-n", ns)
        assert engine["spec"]["replicas"] == 2
        # deleting the ModelDeployment leaves nothing: the GC takes the children, no finalizer sticks
        installed.delete("modeldeployment", md_name, ns, 60)
        eventually(lambda: not children(), 90, "every child garbage-collected")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    assert proc.returncode is not None
    assert "Forbidden" not in text and " 403" not in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]


def test_the_chart_upgrades_and_uninstalls_cleanly(installed: Cluster) -> None:
    installed.helm(
        "upgrade",
        "kvgate",
        "charts/kvgate",
        "--namespace",
        NS,
        "--reuse-values",
        "--set",
        "operator.verbose=true",
    )
    installed.helm("uninstall", "kvgate", "--namespace", NS, "--wait", "--timeout", "120s")
    left = installed.get("deployments,services,serviceaccounts,roles,rolebindings", "-n", NS)["items"]
    assert [i["metadata"]["name"] for i in left if i["metadata"]["name"] != "default"] == []
    cluster_wide = installed.get("clusterroles,clusterrolebindings")["items"]
    assert not [i["metadata"]["name"] for i in cluster_wide if "kvgate" in i["metadata"]["name"]]
    # Helm never deletes what crds/ installed
    assert installed.get("crd", CRDS[0])

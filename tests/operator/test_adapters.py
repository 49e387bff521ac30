"""LoRA adapters of a ModelDeployment, loaded at run time: the real kopf operator against kmock,
with real simulated engines (`kvgate engine serve --simulate`) standing in for the engine pods.

Each engine listens on its own loopback address (127.0.0.2, .3, ...) on the ModelDeployment's
engine port, and a Pod object in kmock carries that address as its podIP, so the operator
reaches "pods" exactly as it would in a cluster: pod IP and spec.engine.port.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.conditions import find, now_rfc3339
from kvgate.operator.resources import (
    CONFIG_MAPS,
    DEPLOYMENTS,
    EVENTS,
    MODEL_DEPLOYMENTS,
    NETWORK_POLICIES,
    PODS,
    SECRETS,
)
from kvgate.testing import eventually
from kvgate.testing import processes as harness

NS = "models"
UID = "6f1c2a9e-0000-4000-8000-0000000000ad"
SERVED = "smollm2"
API_KEY = "adapter-test-key"


def _free_port_on(*hosts: str) -> int:
    for _ in range(50):
        port = harness.free_port()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every address")


class Engines:
    """Simulated engines, one per loopback address, all on one port (a pod's IP and port)."""

    def __init__(self, log_dir: Path, port: int) -> None:
        self.log_dir, self.port = log_dir, port
        self.procs: dict[str, harness.Process] = {}

    def start(self, ip: str, *extra: str) -> str:
        engine = harness.start_engine(
            self.log_dir,
            "--served-model-name", SERVED, "--api-key", API_KEY, *extra,
            "--host", ip, "--port", str(self.port),
            name=f"engine-{ip}",
        )  # fmt: skip
        self.procs[ip] = engine.proc
        eventually(
            lambda: harness.http_get(f"http://{ip}:{self.port}/health")[0] == 200,
            60,
            f"engine on {ip}",
            watch=[engine.proc],
        )
        return ip

    def adapters(self, ip: str) -> dict[str, str]:
        req = urllib.request.Request(
            f"http://{ip}:{self.port}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(req, timeout=2) as resp:
            body = json.loads(resp.read())
        assert all(m["parent"] == SERVED for m in body["data"] if m["parent"])
        return {m["id"]: m["root"] for m in body["data"] if m["parent"]}

    def stop(self) -> None:
        harness.stop_all(*self.procs.values())


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Engines]:
    ips = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    out = Engines(tmp_path, _free_port_on(*ips))
    try:
        yield out
    finally:
        out.stop()


def pod(name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": ch.engine_selector("smol")},
        "spec": {
            "containers": [{"name": "engine", "image": "ghcr.io/kvgate/engine:test"}],
            "readinessGates": [{"conditionType": "kvgate.dev/lora-adapters"}],
        },
        # The engine is up (containers ready); the pod waits on the operator's readiness gate.
        "status": {
            "podIP": ip,
            "conditions": [
                {
                    "type": "ContainersReady",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": now_rfc3339(),
                },
                {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
            ],
        },
    }


def model_deployment(port: int, adapters: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": SERVED},
        "engine": {
            "image": "ghcr.io/kvgate/engine:test",
            "port": port,
            "env": [
                {
                    "name": "KVGATE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": "engine-key", "key": "key"}},
                }
            ],
        },
        "lora": {"maxLoras": 2, "claims": ["loras"]},
        "adapters": adapters,
        **extra,
    }
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "smol", "namespace": NS, "uid": UID},
        "spec": spec,
    }


def status(cluster: Any) -> dict[str, Any]:
    return cluster.objects(MODEL_DEPLOYMENTS).get("smol", {}).get("status") or {}


def adapters_status(cluster: Any) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in status(cluster).get("adapters") or []}


async def create_key_secret(cluster: Any) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-key", "namespace": NS},
              "data": {"key": base64.b64encode(API_KEY.encode()).decode()}}  # fmt: skip
    await cluster.client.create(SECRETS, NS, secret)


def gate(cluster: Any, pod_name: str) -> dict[str, Any] | None:
    pod = cluster.objects(PODS).get(pod_name) or {}
    return find((pod.get("status") or {}).get("conditions"), "kvgate.dev/lora-adapters")


def condition(cluster: Any, type_: str = "Adapters") -> dict[str, Any]:
    return find(status(cluster).get("conditions"), type_) or {}


async def test_adapters_load_and_unload_at_run_time_without_restarting_engines(
    cluster: Any, operator: Any, engines: Engines, validator: Any
) -> None:
    first = [
        {"name": "sql", "source": "/opt/adapters/sql"},
        {"name": "chat", "source": "hf://acme/chat-lora@v1"},
    ]
    md = model_deployment(engines.port, first)
    # The engines get the LoRA flags the operator writes into the pod template.
    lora = ch.lora_args(ModelDeploymentSpec.model_validate(md["spec"]))
    a, b = engines.start("127.0.0.2", *lora), engines.start("127.0.0.3", *lora)
    await create_key_secret(cluster)
    for name, ip in (("smol-a", a), ("smol-b", b)):
        await cluster.client.create(PODS, NS, pod(name, ip))
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, md)

    want = {"sql": "/opt/adapters/sql", "chat": "/adapters/hf/acme--chat-lora@v1"}
    await cluster.eventually(
        lambda: engines.adapters(a) == want and engines.adapters(b) == want, what="both engines serve both"
    )
    await cluster.eventually(lambda: condition(cluster).get("status") == "True", what="Adapters=True")
    assert adapters_status(cluster) == {
        "sql": {"name": "sql", "source": "/opt/adapters/sql", "state": "Loaded", "pods": ["smol-a", "smol-b"]},
        "chat": {"name": "chat", "source": "hf://acme/chat-lora@v1", "state": "Loaded", "pods": ["smol-a", "smol-b"]},
    }  # fmt: skip
    validator.check(cluster.objects(MODEL_DEPLOYMENTS)["smol"])  # status fits the CRD schema
    # Each pod's readiness gate opens once its adapters are loaded (the EPP routes Ready pods only).
    pods = ("smol-a", "smol-b")
    gates = await cluster.eventually(
        lambda: all(gate(cluster, p) for p in pods) and [gate(cluster, p) for p in pods],
        what="readiness gates",
    )
    assert [(g["status"], g["reason"]) for g in gates] == [("True", "AdaptersLoaded")] * 2
    conditions = {c["type"] for c in cluster.objects(PODS)["smol-a"]["status"]["conditions"]}
    assert {"ContainersReady", "Ready", "kvgate.dev/lora-adapters"} <= conditions  # the others kept

    # The engines run with LoRA on and no adapter in their command line; the sidecar's list
    # names the hf:// adapter.
    deployment = cluster.objects(DEPLOYMENTS)["smol"]
    template = copy.deepcopy(deployment["spec"]["template"])
    args = template["spec"]["containers"][0]["args"]
    assert args[args.index("--enable-lora") :][:5] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
    ]
    assert not any("lora-modules" in x or "sql" in x for x in args)
    assert template["spec"]["readinessGates"] == [{"conditionType": "kvgate.dev/lora-adapters"}]
    # The operator reaches the engines' serving port through their NetworkPolicy.
    policy = cluster.objects(NETWORK_POLICIES)["smol"]
    operator_rule = {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvgate-operator"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": engines.port}],
    }
    assert operator_rule in policy["spec"]["ingress"]
    config_map = cluster.objects(CONFIG_MAPS)["smol-adapters"]
    listed = json.loads(config_map["data"]["hf-adapters.json"])
    assert listed == [{"repo": "acme/chat-lora", "revision": "v1", "dir": "acme--chat-lora@v1"}]

    # Swap sql for an adapter on a mounted claim: loaded and unloaded in place.
    second = [first[1], {"name": "code", "source": "pvc://loras/team/code"}]
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"adapters": second}})
    want = {"chat": "/adapters/hf/acme--chat-lora@v1", "code": "/adapters/pvc/loras/team/code"}
    await cluster.eventually(
        lambda: engines.adapters(a) == want and engines.adapters(b) == want, what="sql out, code in"
    )
    await cluster.eventually(
        lambda: (
            set(adapters_status(cluster)) == {"chat", "code"}
            and all(e["state"] == "Loaded" for e in adapters_status(cluster).values())
        ),
        what="status follows",
    )
    # The engines were not touched: same pod template, same processes.
    assert cluster.objects(DEPLOYMENTS)["smol"]["spec"]["template"] == template
    assert all(p.alive() for p in engines.procs.values())

    # A pod whose engine refuses (no --enable-lora): the engine's error in a condition.
    c = engines.start("127.0.0.4")
    await cluster.client.create(PODS, NS, pod("smol-c", c))
    cond = await cluster.eventually(
        lambda: condition(cluster).get("reason") == "LoadFailed" and condition(cluster), what="LoadFailed"
    )
    assert cond["status"] == "False" and "smol-c" in cond["message"] and "HTTP 404" in cond["message"]
    assert adapters_status(cluster)["chat"]["state"] == "Failed"
    assert adapters_status(cluster)["chat"]["pods"] == ["smol-a", "smol-b"]
    assert gate(cluster, "smol-c") is None  # no traffic for a pod without its adapters...
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"lora": {"loadTimeoutSeconds": 1}}})
    late = await cluster.eventually(lambda: gate(cluster, "smol-c"), what="gate after the timeout")
    assert late["reason"] == "LoadTimeout" and "without: chat, code" in late["message"]  # ...not forever
    await cluster.client.delete(PODS, NS, "smol-c")
    await cluster.eventually(lambda: condition(cluster).get("status") == "True", what="Adapters=True again")

    # No adapters left: every one the operator loaded is unloaded, status.adapters empties.
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"adapters": []}})
    await cluster.eventually(lambda: engines.adapters(a) == {} and engines.adapters(b) == {}, what="unloaded")
    await cluster.eventually(lambda: status(cluster).get("adapters") == [], what="status emptied")
    assert cluster.objects(DEPLOYMENTS)["smol"]["spec"]["template"] == template


async def test_invalid_adapters_get_a_condition_and_no_children(cluster: Any, operator: Any) -> None:
    bad = [
        {"name": "sql", "source": "/opt/adapters/sql"},
        {"name": "sql", "source": "/opt/adapters/sql2"},
        {"name": SERVED, "source": "/opt/adapters/x"},
        {"name": "far", "source": "pvc://elsewhere/far"},
        {"name": "big", "source": "/opt/adapters/big", "rank": 64},
        {"name": "s3", "source": "s3://bucket/adapter"},
    ]
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, model_deployment(8000, bad))
    cond = await cluster.eventually(lambda: condition(cluster, "Ready"), what="Ready condition")
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    for needle in (
        "spec.adapters.5.source",  # the pattern, as for spec.model.source
    ):
        assert needle in cond["message"], cond["message"]
    # With the source fixed, the cross-field checks speak.
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "smol", {"spec": {"adapters": bad[:5]}})
    await cluster.eventually(
        lambda: "is used by another adapter" in condition(cluster, "Ready").get("message", "")
    )
    message = condition(cluster, "Ready")["message"]
    assert "adapters[1].name: 'sql' is used by another adapter" in message
    assert f"adapters[2].name: '{SERVED}' is the base model's served name" in message
    assert "adapters[3].source: claim 'elsewhere' is not mounted" in message
    assert "adapters[4].rank: 64 is above lora.maxLoraRank 16" in message
    assert [e for e in cluster.objects(EVENTS).values() if e.get("reason") == "InvalidSpec"]
    assert cluster.children(UID) == {}


async def test_a_new_pod_gets_its_adapters_without_waiting_for_resync(
    cluster: Any, operator_config: Any, engines: Engines
) -> None:
    """With a 30 s resync, a pod whose engine comes up is loaded and let into service at once:
    the operator watches engine pods waiting on its readiness gate."""
    import asyncio
    import dataclasses
    import threading

    import kopf

    from kvgate.operator.handlers import Operator

    config = dataclasses.replace(operator_config, resync_seconds=30.0)
    op = Operator(config, login=lambda **_: kopf.ConnectionInfo(server=cluster.url))
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(op.run(stop_flag=stop, ready_flag=ready)), daemon=True
    )
    thread.start()
    await asyncio.to_thread(ready.wait, 10)
    await cluster.watched("modeldeployments", "deployments", "pods")
    try:
        md = model_deployment(engines.port, [{"name": "sql", "source": "/opt/adapters/sql"}])
        await create_key_secret(cluster)
        await cluster.client.create(MODEL_DEPLOYMENTS, NS, md)
        await cluster.eventually(
            lambda: condition(cluster).get("reason") == "NoReadyEngines", what="first pass, no pods yet"
        )
        lora = ch.lora_args(ModelDeploymentSpec.model_validate(md["spec"]))
        ip = engines.start("127.0.0.2", *lora)
        await asyncio.sleep(
            2
        )  # the passes the children's creation set off are over: only the pod's event is left
        await cluster.client.create(PODS, NS, pod("smol-new", ip))
        await cluster.eventually(lambda: gate(cluster, "smol-new"), within=8, what="gate opened promptly")
        assert engines.adapters(ip) == {"sql": "/opt/adapters/sql"}
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)

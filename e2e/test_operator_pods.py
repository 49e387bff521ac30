"""The engine and EPP pods exactly as the operator writes them, run as processes: command line,
env, Secrets, volumes at their mount paths, read-only root filesystem and non-root user (see
kvgate/testing/pods.py for what is substituted). The model comes from a gated Hub repo (the init
container downloads it; the picker fetches only the tokenizer), the picker discovers the engine
through the in-cluster API (kmock behind TLS, service-account token), turns ready, and a real
Envoy routes an OpenAI request through it to the engine.

Before: the picker of a Hub model exited at start-up (its --tokenizer was never downloaded).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.testing import eventually_async, fake_hub, kube_api
from kvgate.testing import pods as pod_process
from kvgate.testing import processes as harness

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs a private mount namespace (unshare)"),
]

NS = "models"
NAME = "tiny"
HF_TOKEN = "hf_pod_secret"
EARLY = "The quick brown fox jumps over the lazy dog, again and again. " * 12  # ~170 tokens


def spec(source: str, **model: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(
        {
            "model": {"source": source, **model},
            "engine": {"accelerator": "none", "drainSeconds": 0},
            "replicas": 1,
            "routing": {
                "secureServing": True,
                "scorers": [
                    {"type": "queue-scorer", "weight": 1},
                    {"type": "precise-prefix-cache-scorer", "weight": 3},
                ],
            },
        }
    )


async def epp_ready() -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{ch.EPP_HEALTH_PORT}") as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1
            )
        except grpc.aio.AioRpcError:  # not listening yet
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_operator_written_pods_start_and_serve(tmp_path: Path) -> None:
    """A Hub model (a PVC model on a real API server and node: tests/cluster/test_workloads.py)."""
    model = fake_hub.tiny_llama(tmp_path / "model")
    md = spec("hf://acme/tiny-chat@main", hfTokenSecret="hf-token")
    owner = ch.model_deployment_owner(NAME, NS, "uid-1")
    kids = ch.model_deployment_children(
        NAME, owner, md, OperatorConfig(), ch.Capabilities(keda=False, gateway_api=False)
    )
    by_kind_name = {(k["kind"], k["metadata"]["name"]): k for k in kids}
    engine_dep = by_kind_name[("Deployment", NAME)]
    epp_dep = by_kind_name[("Deployment", ch.epp_name(NAME))]
    config_maps = {k["metadata"]["name"]: k["data"] for k in kids if k["kind"] == "ConfigMap" and "data" in k}

    hub = fake_hub.FakeHub()
    hub.add_folder("acme/tiny-chat", model, token=HF_TOKEN)

    logs = tmp_path / "logs"
    logs.mkdir()
    pods: list[pod_process.Pod] = []
    with fake_hub.serve(hub):
        # Only the network is substituted: huggingface.co is the Hub on loopback.
        network = {"HF_ENDPOINT": hub.url}
        async with kube_api.api_server(NS) as api, api.client() as admin:
            try:
                pool = by_kind_name[("InferencePool", NAME)]
                (
                    await admin.post(
                        f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", json=pool
                    )
                ).raise_for_status()
                common: dict[str, Any] = {
                    "secrets": {"hf-token": {"token": HF_TOKEN}},
                    "config_maps": config_maps,
                }
                engine = pod_process.pod_from_deployment(
                    engine_dep, tmp_path / "engine-pod", "engine", service_env=network, **common
                )
                pods.append(engine)
                for init in engine.spec.get("initContainers", []):
                    done = await asyncio.to_thread(engine.run, init, 180)
                    assert done.returncode == 0, done.stderr[-3000:]
                assert "model.safetensors" in hub.downloaded()
                (container,) = engine.spec["containers"]
                running = [engine.start(container, logs / "engine.log")]

                async def engine_healthy() -> bool:
                    async with httpx.AsyncClient() as c:
                        return (await c.get(f"http://127.0.0.1:{md.engine.port}/health")).status_code == 200

                await eventually_async(engine_healthy, 180, "engine /health", interval=0.2, watch=running)
                # Blocks cached before any picker subscribed reach it only through KV-event replay.
                async with httpx.AsyncClient(timeout=60) as c:
                    early = await c.post(
                        f"http://127.0.0.1:{md.engine.port}/v1/completions",
                        json={"model": md.model.effective_served_name(), "prompt": EARLY, "max_tokens": 1},
                    )
                    assert early.status_code == 200, early.text
                (
                    await admin.post(f"/api/v1/namespaces/{NS}/pods", json=engine.as_pod_object())
                ).raise_for_status()

                hub.requests.clear()
                epp = pod_process.pod_from_deployment(
                    epp_dep,
                    tmp_path / "epp-pod",
                    "epp",
                    service_account_dir=api.sa_dir,
                    service_env={**api.env, **network},
                    **common,
                )
                pods.append(epp)
                (container,) = epp.spec["containers"]
                running.append(epp.start(container, logs / "epp.log"))
                await eventually_async(epp_ready, 120, "EPP readiness", interval=0.2, watch=running)
                async with httpx.AsyncClient() as c:
                    text = (await c.get(f"http://127.0.0.1:{ch.EPP_METRICS_PORT}/metrics")).text
                held = [
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("kvgate_epp_prefix_index_blocks{") and f":{md.engine.port}" in line
                ]
                assert held and held[0] >= 8, text[-2000:]  # the early prompt's blocks, replayed
                fetched = hub.downloaded()
                assert "tokenizer.json" in fetched and "model.safetensors" not in fetched

                # A real Envoy (TLS to the picker, as the chart's gateway) routes through it.
                envoy = harness.start_envoy(logs, ch.EPP_GRPC_PORT, epp_tls=True)
                try:
                    await asyncio.to_thread(envoy.wait_ready)
                    served = md.model.effective_served_name()
                    async with httpx.AsyncClient(timeout=60) as c:
                        resp = await c.post(
                            f"{envoy.url}/v1/completions",
                            json={"model": served, "prompt": "Hello there", "max_tokens": 4},
                        )
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["usage"]["completion_tokens"] == 4
                    assert resp.headers.get("x-kvgate-upstream", "").endswith(f":{md.engine.port}")
                finally:
                    harness.stop_all(envoy.proc)
            finally:
                for pod in pods:
                    await asyncio.to_thread(pod.stop)

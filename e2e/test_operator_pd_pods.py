"""A disaggregated ModelDeployment's pods exactly as the operator writes them, run as processes
(kvgate/testing/pods.py: command line, env incl. the KV-transfer Secret, volumes, non-root): a
prefill engine (`--kv-role producer`, pod label kvgate.dev/role=prefill), a decode engine
(`--kv-role consumer`, role decode) and the picker with `--pd-threshold`, which learns each
engine's role from its pod label through the in-cluster API (kmock behind TLS). A real Envoy
routes: a long prompt is prefilled on the prefill engine and its KV pulled by the decode engine
(signed with the shared secret), a short one stays on the decode engine, and the decode engine
is the only destination.

The two engine pods share this machine's network, so each is given its own loopback address
through its role's `args` (the flags after the operator's win), as a pod IP would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.children import disaggregation as pd
from kvgate.operator.config import OperatorConfig
from kvgate.testing import eventually_async, fake_hub, kube_api
from kvgate.testing import pods as pod_process
from kvgate.testing import processes as harness
from kvgate.testing.local_up import engine_gauges

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs a private mount namespace (unshare)"),
]

NS = "models"
NAME = "tiny"
IPS = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}
LONG = "Rivers carry the memory of rain across valleys and stone, slowly, without hurry. " * 6
SHORT = "Hi"


def own_address(ip: str) -> list[str]:
    return [
        "--host",
        ip,
        "--kv-events-endpoint",
        f"tcp://{ip}:5557",
        "--kv-events-replay-endpoint",
        f"tcp://{ip}:5558",
    ]


def split_spec() -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(
        {
            "model": {"source": "pvc://weights/tiny"},
            "engine": {"accelerator": "none", "drainSeconds": 0},
            "routing": {
                "scorers": [
                    {"type": "queue-scorer", "weight": 1},
                    {"type": "precise-prefix-cache-scorer", "weight": 3},
                ]
            },
            "disaggregation": {
                "prefill": {"args": own_address(IPS["prefill"])},
                "decode": {"args": own_address(IPS["decode"])},
                "threshold": 32,
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
        except grpc.aio.AioRpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def counters(role: str) -> dict[str, float]:
    return engine_gauges(f"http://{IPS[role]}:8000")


async def test_operator_written_split_pods_hand_off_long_prompts(tmp_path: Path) -> None:
    claim = tmp_path / "claim"
    claim.mkdir(mode=0o755)
    model = fake_hub.tiny_llama(claim / "tiny")
    for f in [model, *model.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)

    md = split_spec()
    owner = ch.model_deployment_owner(NAME, NS, "uid-1")
    kids = ch.model_deployment_children(
        NAME, owner, md, OperatorConfig(), ch.Capabilities(keda=False, gateway_api=False)
    )
    by = {(k["kind"], k["metadata"]["name"]): k for k in kids}
    config_maps = {k["metadata"]["name"]: k["data"] for k in kids if k["kind"] == "ConfigMap" and "data" in k}
    # The Secret's value as the kubelet hands it to the container (the operator makes it random).
    common: dict[str, Any] = {
        "secrets": {pd.kv_transfer_secret_name(NAME): {pd.KV_SECRET_KEY: "s3cret-shared-by-the-pool"}},
        "claims": {"weights": claim},
        "config_maps": config_maps,
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    pods: list[pod_process.Pod] = []
    async with kube_api.api_server(NS) as api, api.client() as admin:
        try:
            pool = by[("InferencePool", NAME)]
            (
                await admin.post(
                    f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", json=pool
                )
            ).raise_for_status()
            running = []
            for role in ("prefill", "decode"):
                dep = by[("Deployment", pd.role_name(NAME, role))]
                pod = pod_process.pod_from_deployment(
                    dep, tmp_path / f"{role}-pod", "engine", pod_ip=IPS[role], **common
                )
                pods.append(pod)
                (container,) = pod.spec["containers"]
                running.append(pod.start(container, logs / f"{role}.log"))
            for role in ("prefill", "decode"):

                async def healthy(ip: str = IPS[role]) -> bool:
                    async with httpx.AsyncClient() as c:
                        try:
                            return (await c.get(f"http://{ip}:8000/health")).status_code == 200
                        except httpx.TransportError:
                            return False

                await eventually_async(healthy, 180, f"{role} engine /health", interval=0.2, watch=running)
            for pod in pods:
                assert pod.labels[pd.LABEL_ROLE] in ("prefill", "decode")
                (
                    await admin.post(f"/api/v1/namespaces/{NS}/pods", json=pod.as_pod_object())
                ).raise_for_status()

            epp = pod_process.pod_from_deployment(
                by[("Deployment", ch.epp_name(NAME))],
                tmp_path / "epp-pod",
                "epp",
                service_account_dir=api.sa_dir,
                service_env=api.env,
                **common,
            )
            pods.append(epp)
            (container,) = epp.spec["containers"]
            assert "--pd-threshold" in container["args"]
            running.append(epp.start(container, logs / "epp.log"))
            await eventually_async(epp_ready, 120, "EPP readiness", interval=0.2, watch=running)

            envoy = harness.start_envoy(logs, ch.EPP_GRPC_PORT, epp_tls=True)
            try:
                await asyncio.to_thread(envoy.wait_ready)
                served = md.model.effective_served_name()
                before = {role: counters(role) for role in IPS}
                async with httpx.AsyncClient(timeout=60) as c:
                    for prompt in (LONG, SHORT):
                        resp = await c.post(
                            f"{envoy.url}/v1/completions",
                            json={"model": served, "prompt": prompt, "max_tokens": 4},
                        )
                        assert resp.status_code == 200, resp.text
                        assert resp.json()["usage"]["completion_tokens"] == 4
                        # The decode engine is the only destination.
                        assert resp.headers.get("x-kvgate-upstream") == f"{IPS['decode']}:8000"
                after = {role: counters(role) for role in IPS}

                def grew(role: str, metric: str) -> float:
                    return after[role].get(metric, 0.0) - before[role].get(metric, 0.0)

                # One hand-off (the long prompt), pulled and signed with the pool's secret.
                assert grew("prefill", "kvgate:kv_transfer_requests_total") == 1
                assert grew("decode", "kvgate:kv_transfer_requests_total") == 1
                assert grew("decode", "kvgate:kv_transfer_bytes_total") > 0
                assert grew("decode", "kvgate:kv_transfer_fallbacks_total") == 0
                assert grew("decode", "vllm:external_prefix_cache_hits_total") > 0
            finally:
                harness.stop_all(envoy.proc)
        finally:
            for pod in pods:
                await asyncio.to_thread(pod.stop)

"""InferencePool discovery against kmock's in-memory Kubernetes API: endpoints come and go
with Ready pods, without restarts."""

from __future__ import annotations

import asyncio

import httpx
import kmock
import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.k8s import PoolWatcher, endpoints_for, pool_spec
from kvgate.testing import eventually_async
from kvgate.testing import processes as harness

NS = "models"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
PODS = f"/api/v1/namespaces/{NS}/pods"


def pod(name: str, ip: str, ready: bool = True, app: str = "llm", phase: str = "Running") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "pool", "namespace": NS},
    "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]},
}


def test_endpoints_for_pool_spec() -> None:
    spec = pool_spec(
        {
            "spec": {
                "selector": {"matchLabels": {"app": "llm"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
            }
        }
    )
    pods = {
        "a": pod("a", "10.0.0.1"),
        "b": pod("b", "10.0.0.2", ready=False),
        "c": pod("c", "10.0.0.3", app="other"),
        "d": pod("d", "10.0.0.4", phase="Pending"),
        "e": pod("e", "fd00::5"),
    }
    eps = endpoints_for(pods, spec, kv_events_port=5557, kv_replay_port=0)
    assert [e.address for e in eps] == ["10.0.0.1:8000", "10.0.0.1:8001", "[fd00::5]:8000", "[fd00::5]:8001"]
    assert eps[0].kv_events == "tcp://10.0.0.1:5557" and eps[0].kv_replay is None and eps[0].name == "a"


async def patch(api: httpx.AsyncClient, path: str, obj: dict) -> None:
    resp = await api.patch(path, json=obj, headers={"content-type": "application/merge-patch+json"})
    resp.raise_for_status()


@pytest.mark.timeout(30)
async def test_pool_watch_follows_pods_without_restart() -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
            kind="InferencePool",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )
        emulator.resources["v1/pods"] = kmock.ResourceInfo(
            kind="Pod", namespaced=True, verbs={"get", "list", "watch", "create", "update", "patch", "delete"}
        )
        async with httpx.AsyncClient(base_url=str(server.url)) as api:
            (await api.post(PODS, json=pod("a", "10.0.0.1"))).raise_for_status()
            (await api.post(PODS, json=pod("b", "10.0.0.2", ready=False))).raise_for_status()
            ds = Datastore()
            watcher = PoolWatcher(
                ds, "pool", NS, kv_events_port=5557, api_server=str(server.url), retry_seconds=0.1
            )
            task = asyncio.create_task(watcher.run())
            try:
                await eventually_async(
                    lambda: any(r.resource and r.resource.plural == "inferencepools" for r in emulator),
                    what="the watcher looked for its pool",
                )
                assert not ds.synced  # no pool yet: not ready
                (await api.post(POOLS, json=POOL)).raise_for_status()
                await eventually_async(
                    lambda: ds.synced and [s.address for s in ds.all()] == ["10.0.0.1:8000"]
                )
                assert ds.get("10.0.0.1:8000").endpoint.kv_events == "tcp://10.0.0.1:5557"
                # a new Ready pod appears; the unready one becomes ready
                (await api.post(PODS, json=pod("c", "10.0.0.3"))).raise_for_status()
                await patch(api, f"{PODS}/b", pod("b", "10.0.0.2"))
                await eventually_async(
                    lambda: (
                        sorted(s.address for s in ds.all())
                        == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
                    )
                )
                # one is deleted, one goes unready
                (await api.delete(f"{PODS}/a")).raise_for_status()
                await patch(api, f"{PODS}/c", pod("c", "10.0.0.3", ready=False))
                await eventually_async(lambda: [s.address for s in ds.all()] == ["10.0.0.2:8000"])
                # the pool's target port changes
                changed = {**POOL, "spec": {**POOL["spec"], "targetPorts": [{"number": 9000}]}}
                await patch(api, f"{POOLS}/pool", changed)
                await eventually_async(lambda: [s.address for s in ds.all()] == ["10.0.0.2:9000"])
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(60)
async def test_epp_process_discovers_pool_and_turns_ready(tmp_path) -> None:
    """The real `kvgate epp serve --pool-name` process against kmock: not ready until the pool
    exists, then its endpoints follow the pods."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        for key, kind in (
            ("inference.networking.k8s.io/v1/inferencepools", "InferencePool"),
            ("v1/pods", "Pod"),
        ):
            emulator.resources[key] = kmock.ResourceInfo(
                kind=kind,
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
        grpc_port, health_port, metrics_port = harness.free_ports(3)
        argv = [
            *harness.KVGATE, "epp", "serve", "--pool-name", "pool", "--pool-namespace", NS,
            "--kube-api-server", str(server.url), "--profile", "random", "--secure-serving=false",
            "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
        ]  # fmt: skip
        proc = harness.Process("epp", argv, tmp_path / "epp.log").start()

        async def readiness() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                return resp.status

        async def endpoints() -> list[str]:
            async with httpx.AsyncClient() as c:
                text = (await c.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            return sorted(
                line.split('endpoint="')[1].split('"')[0]
                for line in text.splitlines()
                if line.startswith("kvgate_epp_prefix_index_blocks{")
            )

        try:

            async def answer() -> tuple[int]:
                return (await readiness(),)  # whatever the status (UNKNOWN is 0)

            (status,) = await eventually_async(answer, 20, "the EPP's gRPC health", watch=[proc])
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # no pool yet
            async with httpx.AsyncClient(base_url=str(server.url)) as api:
                (await api.post(PODS, json=pod("a", "10.0.0.1"))).raise_for_status()
                (await api.post(POOLS, json=POOL)).raise_for_status()

                async def serving() -> bool:
                    return await readiness() == health_pb2.HealthCheckResponse.SERVING and bool(
                        await endpoints()
                    )

                await eventually_async(serving, 10, "ready with endpoints", watch=[proc])
                assert await endpoints() == ["10.0.0.1:8000"]
                (await api.post(PODS, json=pod("b", "10.0.0.2"))).raise_for_status()
                await patch(api, f"{PODS}/a", pod("a", "10.0.0.1", ready=False))

                async def only_b() -> bool:
                    return await endpoints() == ["10.0.0.2:8000"]

                await eventually_async(only_b, 10, "the endpoints following the pods", watch=[proc])
                assert proc.alive()  # no restart needed
        finally:
            proc.stop()

"""A pod being deleted (deletionTimestamp set, still Ready while its preStop runs) leaves the
candidate set at once, on kmock's in-memory Kubernetes API."""

from __future__ import annotations

import asyncio

import httpx
import kmock
import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.k8s import PoolWatcher
from kvgate.testing import eventually_async

NS = "models"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "pool", "namespace": NS},
    "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]},
}


def pod(name: str, ip: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "llm"}},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.mark.timeout(30)
async def test_terminating_pod_leaves_while_still_ready() -> None:
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
        async with httpx.AsyncClient(base_url=str(server.url)) as api:
            for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2")):
                (await api.post(PODS, json=pod(name, ip))).raise_for_status()
            (await api.post(POOLS, json=POOL)).raise_for_status()
            ds = Datastore()
            watcher = PoolWatcher(
                ds, "pool", NS, kv_events_port=0, api_server=str(server.url), retry_seconds=0.1
            )
            task = asyncio.create_task(watcher.run())
            try:
                await eventually_async(
                    lambda: sorted(s.address for s in ds.all()) == ["10.0.0.1:8000", "10.0.0.2:8000"],
                    what="both pods",
                )
                # what the API server does on `kubectl delete` while the pod runs its preStop hook:
                # the pod stays, Ready, with a deletionTimestamp
                terminating = pod("a", "10.0.0.1")
                terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                resp = await api.patch(
                    f"{PODS}/a", json=terminating, headers={"content-type": "application/merge-patch+json"}
                )
                resp.raise_for_status()
                assert resp.json()["metadata"].get("deletionTimestamp")  # kmock kept it
                await eventually_async(
                    lambda: [s.address for s in ds.all()] == ["10.0.0.2:8000"],
                    what="the terminating pod gone",
                )
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

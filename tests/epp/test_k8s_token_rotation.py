"""The EPP's in-cluster discovery keeps working when its projected service-account token rotates
(the kubelet rewrites the file before the 1 h expiry): the file is re-read when the copy in hand
is a minute old, and at once on a 401. Against kmock behind TLS, accepting only valid tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.k8s import PoolWatcher, ServiceAccountToken
from kvgate.testing import eventually_async, kube_api

NS = "models"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "pool", "namespace": NS},
    "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]},
}
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "a", "namespace": NS, "labels": {"app": "llm"}},
    "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
}


@pytest.mark.timeout(60)
async def test_discovery_survives_a_rotated_and_revoked_token(monkeypatch: pytest.MonkeyPatch) -> None:
    async with kube_api.api_server(NS) as api, api.client() as admin:
        other = {**POD, "metadata": {**POD["metadata"], "name": "b", "labels": {"app": "llm2"}}}
        other["status"] = {**POD["status"], "podIP": "10.0.0.2"}
        for path, obj in ((POOLS, POOL), (PODS, POD), (PODS, other)):
            (await admin.post(path, json=obj)).raise_for_status()
        for key, value in api.env.items():
            monkeypatch.setenv(key, value)
        ds = Datastore()
        watcher = PoolWatcher(ds, "pool", NS, retry_seconds=0.1, service_account_dir=api.sa_dir)
        task = asyncio.create_task(watcher.run())
        try:
            await eventually_async(lambda: [s.address for s in ds.all()] == ["10.0.0.1:8000"], what="pod a")
            assert api.emulator.refused == 0

            api.rotate("token-2")  # the old token is revoked at once
            async with api.client() as admin2:
                moved = {**POOL, "spec": {**POOL["spec"], "selector": {"matchLabels": {"app": "llm2"}}}}
                resp = await admin2.patch(
                    f"{POOLS}/pool", json=moved, headers={"content-type": "application/merge-patch+json"}
                )
                resp.raise_for_status()
                # The old pod watch ends with the selector change; a pod created now reaches the
                # picker only through a new list or watch request.
                third = {**other, "metadata": {**other["metadata"], "name": "c"}}
                third["status"] = {**POD["status"], "podIP": "10.0.0.3"}
                (await admin2.post(PODS, json=third)).raise_for_status()
            # The pool watch stream was opened with the old token and keeps flowing; the pods of
            # the new selector come only from a new list request: refused once, then sent again
            # with the new token.
            await eventually_async(
                lambda: [s.address for s in ds.all()] == ["10.0.0.2:8000", "10.0.0.3:8000"],
                what="the pods of the new selector",
            )
            assert api.emulator.refused >= 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_token_is_reread_once_a_minute_old(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one\n")
    auth = ServiceAccountToken(path, max_age=60.0, clock=lambda: now[0])
    assert auth.token() == "one"
    path.write_text("two")
    now[0] = 59.0
    assert auth.token() == "one"  # no file read per request
    now[0] = 60.0
    assert auth.token() == "two"
    path.unlink()  # mid-rotation: keep the last good token rather than send none
    assert auth.token(fresh=True) == "two"

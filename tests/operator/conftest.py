"""Runs the real kopf operator against kmock's Kubernetes emulator, in this test's event loop."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import jsonpatch
import kmock
import kopf
import pytest

from kvgate.operator.config import OperatorConfig
from kvgate.operator.handlers import Operator
from kvgate.operator.kube import Credentials, KubeClient
from kvgate.operator.resources import (
    BY_KIND,
    CRDS,
    EVENTS,
    HTTP_ROUTES,
    NAMESPACES,
    SCALED_OBJECTS,
    Resource,
)

NS = "models"
RESYNC_S = 0.4


_versions = itertools.count(100)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what kopf relies on from a real API server: a resourceVersion that
    changes on every write (kopf tells its own echoes from news by it), a uid and creation
    timestamp on create, and a generation that counts spec changes."""

    async def _handle(self, request: Any) -> Any:
        data = request.data
        if request.resource is not None and data is not None:
            version = str(next(_versions))
            if request.action == kmock.action.CREATE and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", "2026-12-02T00:00:00Z")
                meta["resourceVersion"] = version
                meta["generation"] = 1
            elif request.action == kmock.action.UPDATE and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if "spec" in data and request.subresource is None:
                    key = (request.resource, request.namespace, request.name)
                    current = self.objects[key] if key in self.objects else None
                    generation = (
                        (dict(current.raw).get("metadata") or {}).get("generation", 1) if current else 1
                    )
                    meta["generation"] = generation + 1
            elif request.action == kmock.action.UPDATE and isinstance(data, list):
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            # The API server answers a failed `test` op with 422; kopf then retries on the next event.
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None


def register(emulator: Emulator, res: Resource) -> None:
    # kopf learns what exists from discovery; without these entries it watches nothing.
    emulator.resources[res.key] = kmock.ResourceInfo(
        kind=res.kind,
        namespaced=res.namespaced,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status"},
    )


@dataclass
class Cluster:
    emulator: Emulator
    client: KubeClient
    url: str
    ns: str = NS

    @staticmethod
    async def eventually(check: Callable[[], Any], within: float = 10.0, what: str = "condition") -> Any:
        return await eventually(check, within, what)

    def objects(self, res: Resource, namespace: str = NS) -> dict[str, dict[str, Any]]:
        out = {}
        for (r, ns, name), obj in self.emulator.objects.items():
            if r.plural == res.plural and r.group == res.group and ns == namespace and not obj.deleted:
                out[name] = dict(obj.raw)
        return out

    def children(self, owner_uid: str, namespace: str = NS) -> dict[tuple[str, str], dict[str, Any]]:
        """Every live object whose ownerReferences name this uid, keyed (kind, name)."""
        out = {}
        for (_r, ns, name), obj in self.emulator.objects.items():
            if obj.deleted or ns != namespace:
                continue
            raw = dict(obj.raw)
            refs = raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                out[(raw["kind"], name)] = raw
        return out

    async def collect_garbage(self, namespace: str = NS) -> int:
        """kmock has no garbage collector: delete objects whose controller owner is gone."""
        alive = {
            (dict(o.raw).get("metadata") or {}).get("uid")
            for (_r, ns, _n), o in self.emulator.objects.items()
            if not o.deleted
        }
        deleted = 0
        for (r, ns, name), obj in list(self.emulator.objects.items()):
            if obj.deleted or ns != namespace:
                continue
            refs = dict(obj.raw).get("metadata", {}).get("ownerReferences") or []
            if refs and not any(ref.get("uid") in alive for ref in refs):
                res = next(x for x in BY_KIND.values() if x.plural == r.plural and x.group == r.group)
                await self.client.delete(res, ns, name)
                deleted += 1
        return deleted


async def eventually(check: Callable[[], Any], within: float = 10.0, what: str = "condition") -> Any:
    """Polls `check` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if isinstance(last, Awaitable):
                last = await last
            if last:
                return last
        except (AssertionError, KeyError, TypeError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture
def keda() -> bool:
    return True


@pytest.fixture
def operator_config() -> OperatorConfig:
    return OperatorConfig(namespaces=(NS,), resync_seconds=RESYNC_S, standalone=True, scanning=False)


@pytest.fixture
async def cluster(keda: bool) -> AsyncIterator[Cluster]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources[CRDS.key] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"}
        )
        # kopf waits for v1/namespaces to be discovered before it watches anything; kmock cannot
        # parse /api/v1/namespaces itself, so the operator runs with scanning off (exact names).
        register(emulator, NAMESPACES)
        register(emulator, EVENTS)
        for res in BY_KIND.values():
            if res is SCALED_OBJECTS and not keda:
                continue
            register(emulator, res)
        assert HTTP_ROUTES in BY_KIND.values()
        client = KubeClient(Credentials(server=str(server.url)))
        try:
            yield Cluster(emulator, client, str(server.url))
        finally:
            await client.close()


@pytest.fixture
async def operator(cluster: Cluster, operator_config: OperatorConfig) -> AsyncIterator[Operator]:
    """The operator in its own thread and event loop, as it would run in its own process."""
    op = Operator(operator_config, login=lambda **_: kopf.ConnectionInfo(server=cluster.url))
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(op.run(stop_flag=stop, ready_flag=ready)), name="kopf", daemon=True
    )
    thread.start()
    await asyncio.to_thread(ready.wait, 10)
    try:
        yield op
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive(), "the operator did not stop"

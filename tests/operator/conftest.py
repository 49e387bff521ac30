"""Operator test harness: kmock (made a little more like a real API server) with the real kopf
operator in its own thread, and validators for every kind kvgate emits."""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import jsonpatch
import jsonschema
import kmock
import kopf
import pytest
import referencing
from kubernetes_validate import utils as kv_utils

from kvgate.operator.config import OperatorConfig
from kvgate.operator.handlers import Operator
from kvgate.operator.kube import Credentials, KubeClient
from kvgate.operator.resources import (
    BY_KIND,
    CRDS,
    EVENTS,
    HTTP_ROUTES,
    NAMESPACES,
    PODS,
    SCALED_OBJECTS,
    SECRETS,
    Resource,
)
from kvgate.testing import eventually_async, foreign_schemas

NS = "models"
RESYNC_S = 0.4


_versions = itertools.count(100)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what kopf relies on from a real API server: a resourceVersion that
    changes on every write (kopf tells its own echoes from news by it), a uid and creation
    timestamp on create, and a generation that counts spec changes.

    It also keeps each request's cost constant. kmock decides which of its reactions serves a
    request by checking that the request is among the requests each reaction's filter sees,
    and it finds them by scanning every request served so far: a request cost O(requests
    served), and the kopf operator's passes (dozens of requests each) slowed down as a test went
    on, to ~30 ms a GET after a few seconds and a second or more per pass; the update a test
    waits for queued behind such passes for longer than the test's 10 s when the machine was
    busy. kmock's own log now holds only the requests in flight; `requests()` has them all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[Any] = []

    def requests(self) -> list[Any]:
        """Every request received so far, served or in flight, in arrival order."""
        return list(self.received)

    async def _handle(self, request: Any) -> Any:
        self.received.append(request)
        try:
            return await self._emulate(request)
        finally:
            for i in range(len(self._requests) - 1, -1, -1):
                if self._requests[i] is request:
                    del self._requests[i]
                    break

    async def _emulate(self, request: Any) -> Any:
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

    async def watched(self, *plurals: str) -> None:
        """Waits until kopf watches these resources. kmock replays a watch from the current
        state, not from the listed resourceVersion: an object changed between kopf's list and
        its watch would be seen stale, so tests start writing only once the watches stand."""

        def watching() -> bool:
            seen = {
                r.resource.plural
                for r in self.emulator.requests()
                if r.action == kmock.action.WATCH and r.resource
            }
            return set(plurals) <= seen

        await eventually_async(watching, 10, f"watch-streams on {plurals}")

    @staticmethod
    async def eventually(check: Callable[[], Any], within: float = 10.0, what: str = "condition") -> Any:
        return await eventually_async(check, within, what)

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


@pytest.fixture
def keda() -> bool:
    return True


@pytest.fixture
def gateway_api() -> bool:
    return True


@pytest.fixture
def operator_config() -> OperatorConfig:
    return OperatorConfig(namespaces=(NS,), resync_seconds=RESYNC_S, standalone=True, scanning=False)


@pytest.fixture
async def cluster(keda: bool, gateway_api: bool) -> AsyncIterator[Cluster]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources[CRDS.key] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"}
        )
        # kopf waits for v1/namespaces to be discovered before it watches anything; kmock cannot
        # parse /api/v1/namespaces itself, so the operator runs with scanning off (exact names).
        register(emulator, NAMESPACES)
        register(emulator, EVENTS)
        register(emulator, PODS)  # engine pods the operator loads LoRA adapters into
        register(emulator, SECRETS)
        for res in BY_KIND.values():
            if (res is SCALED_OBJECTS and not keda) or (res is HTTP_ROUTES and not gateway_api):
                continue
            register(emulator, res)
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
    await cluster.watched("modeldeployments", "inferencepools", "deployments")
    try:
        yield op
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive(), "the operator did not stop"


# ---------------------------------------------------------------------------------------------
# Schema validation: real Kubernetes schemas for built-in kinds, CRD schemas for the rest.
# ---------------------------------------------------------------------------------------------

K8S_VERSION = "1.37"
ROOT = Path(__file__).resolve().parents[2]


def _strict_jsonschema(node: Any) -> Any:
    """A CRD's OpenAPI v3 schema as a JSON schema, with unknown fields rejected (like
    `kubectl apply --validate=strict`) and Kubernetes' extensions expressed in JSON schema."""
    if isinstance(node, list):
        return [_strict_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out = {k: v for k, v in out.items() if k != "type"}
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in node
    ):
        out["additionalProperties"] = False
    return out


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting, so CEL rules see what they would see in a cluster."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = _apply_defaults(sub, out[key])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(schema["items"], v) for v in value]
    return value


def _cel_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    failures: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _CEL.program(_CEL.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            failures.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                failures += _cel_failures(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            failures += _cel_failures(schema["items"], item, f"{path}[{i}]")
    return failures


_CEL = celpy.Environment()


@functools.cache
def _k8s_definitions() -> tuple[str, Any]:
    version = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == K8S_VERSION][-1]
    schema_dir = f"v{version}-local-strict"
    return schema_dir, kv_utils.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/_definitions.json", version
    )


@functools.cache
def _k8s_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema for a built-in kind (as its validate() loads it),
    built once: loading the definitions per object would dominate the test time."""
    schema_dir, definitions = _k8s_definitions()
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(
            f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", K8S_VERSION
        )
    except FileNotFoundError:
        raise AssertionError(f"no Kubernetes {K8S_VERSION} schema for {api_version} {kind}") from None
    registry = referencing.Resource.from_contents(schema) @ referencing.Registry()
    registry = referencing.Resource.from_contents(definitions) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


class Validator:
    """Validates any object kvgate emits: built-in kinds with kubernetes-validate (strict, a
    current Kubernetes), our kinds with our CRDs' schemas and CEL rules, KEDA's, Gateway API's
    and the Prometheus Operator's kinds with the schemas in foreign_schemas.py."""

    def __init__(self) -> None:
        from kvgate.api.k8s.crds import crd_manifests

        self.openapi: dict[tuple[str, str], dict[str, Any]] = {}
        for crd in crd_manifests():
            version = crd["spec"]["versions"][0]
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            self.openapi[key] = version["schema"]["openAPIV3Schema"]
        self.openapi[("keda.sh/v1alpha1", "ScaledObject")] = foreign_schemas.SCALED_OBJECT
        self.openapi[("gateway.networking.k8s.io/v1", "HTTPRoute")] = foreign_schemas.HTTP_ROUTE
        for kind, schema in (
            ("PodMonitor", foreign_schemas.POD_MONITOR),
            ("ServiceMonitor", foreign_schemas.SERVICE_MONITOR),
            ("PrometheusRule", foreign_schemas.PROMETHEUS_RULE),
        ):
            self.openapi[("monitoring.coreos.com/v1", kind)] = schema

    @functools.cache  # noqa: B019  (one session-wide instance)
    def _crd_validator(self, key: tuple[str, str]) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator(_strict_jsonschema(self.openapi[key]))

    def errors(self, obj: dict[str, Any]) -> list[str]:
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        if key in self.openapi:
            found = [
                f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in self._crd_validator(key).iter_errors(obj)
            ]
            if not found:
                found = _cel_failures(self.openapi[key], _apply_defaults(self.openapi[key], obj))
            return found
        return [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _k8s_validator(*key).iter_errors(obj)
        ]

    def check(self, obj: dict[str, Any]) -> None:
        problems = self.errors(obj)
        name = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        assert not problems, f"{name} is invalid: {problems}"


@pytest.fixture(scope="session")
def validator() -> Validator:
    return Validator()

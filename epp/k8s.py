"""Kubernetes discovery: the InferencePool's selector and target ports → its Ready pods.

Plain REST list+watch against the API server (in-cluster service account, or an explicit
server URL), so the EPP needs no Kubernetes client library on its hot process. Pods are
filtered client-side as well as by label selector, so an API server that ignores the selector
(test emulators) still yields the right endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvgate.api.contracts.disaggregation import ROLE_BOTH, ROLE_LABEL, ROLES
from kvgate.api.k8s.crds import InferencePoolSpec
from kvgate.epp.datastore import Datastore, Endpoint

log = logging.getLogger("kvgate.epp.k8s")

POOL_API = "/apis/inference.networking.k8s.io/v1"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class PoolSpec:
    match_labels: dict[str, str]
    target_ports: tuple[int, ...]


def pool_spec(pool: dict[str, Any]) -> PoolSpec:
    """The selector and target ports of a GIE v1 InferencePool, read with the same pydantic model
    the CRD is generated from. Raises ValueError (pydantic's ValidationError) for a pool that
    does not parse: routing by a half-read pool would send traffic to the wrong pods."""
    spec = InferencePoolSpec.model_validate((pool or {}).get("spec") or {})
    return PoolSpec(dict(spec.selector.match_labels), tuple(p.number for p in spec.target_ports))


def pod_ready(pod: dict[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


_warned_roles: set[tuple[str, str]] = set()


def pod_role(pod: dict[str, Any]) -> str:
    """The pod's ``kvgate.dev/role`` label; absent: both. An unknown value (a typo) also counts as
    both, with a warning: taking the pod out of the pool would be a worse surprise."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    role = labels.get(ROLE_LABEL)
    if role is None:
        return ROLE_BOTH
    if role not in ROLES:
        name = (pod.get("metadata") or {}).get("name", "?")
        if (name, role) in _warned_roles:  # once per pod and value: the list is rebuilt per pod event
            return ROLE_BOTH
        _warned_roles.add((name, role))
        log.warning(
            "pod %s: label %s=%r is not one of %s; serving it as both",
            name,
            ROLE_LABEL,
            role,
            ", ".join(ROLES),
        )
        return ROLE_BOTH
    return str(role)


def endpoints_for(
    pods: dict[str, dict[str, Any]], spec: PoolSpec, kv_events_port: int, kv_replay_port: int
) -> list[Endpoint]:
    out: list[Endpoint] = []
    for name, pod in sorted(pods.items()):
        if not matches(pod, spec.match_labels) or not pod_ready(pod):
            continue
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        role = pod_role(pod)
        for port in spec.target_ports:
            out.append(
                Endpoint(
                    address=f"{host}:{port}",
                    kv_events=f"tcp://{host}:{kv_events_port}" if kv_events_port else None,
                    kv_replay=f"tcp://{host}:{kv_replay_port}" if kv_replay_port else None,
                    name=name,
                    role=role,
                )
            )
    return out


class ServiceAccountToken(httpx.Auth):
    """The pod's projected service-account token, re-read the way client-go does.

    Projected tokens rotate (the kubelet rewrites the file well before the default 1 h expiry),
    so the file is read again once the copy in hand is `max_age` seconds old, and at once when
    the API server answers 401 (the request is then sent again, once, with the new token).
    """

    def __init__(
        self, path: Path, max_age: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path, self.max_age, self.clock = path, max_age, clock
        self._token = ""
        self._read_at = float("-inf")

    def token(self, fresh: bool = False) -> str:
        if fresh or self.clock() - self._read_at >= self.max_age:
            try:
                self._token = self.path.read_text().strip()
                self._read_at = self.clock()
            except OSError as exc:  # mid-rotation, or gone: keep the last good token
                log.warning("cannot read the service-account token %s: %s", self.path, exc)
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        sent = self.token()
        request.headers["Authorization"] = f"Bearer {sent}"
        response = yield request
        if response.status_code == 401:
            fresh = self.token(fresh=True)
            if fresh != sent:
                log.info("API server refused the service-account token; retrying with the rotated one")
                request.headers["Authorization"] = f"Bearer {fresh}"
                yield request


def _client(api_server: str | None, sa_dir: Path = SA_DIR) -> httpx.AsyncClient:
    if api_server:
        return httpx.AsyncClient(base_url=api_server, timeout=httpx.Timeout(10, read=None))
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset) and no API server given")
    auth = ServiceAccountToken(sa_dir / "token")
    if not auth.token():
        raise RuntimeError(
            f"no service-account token at {sa_dir / 'token'} (automountServiceAccountToken off?)"
        )
    ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
    host = f"[{host}]" if ":" in host else host
    return httpx.AsyncClient(
        base_url=f"https://{host}:{port}", verify=ctx, auth=auth, timeout=httpx.Timeout(10, read=None)
    )


class PoolWatcher:
    def __init__(
        self,
        datastore: Datastore,
        pool_name: str,
        namespace: str,
        kv_events_port: int = 0,
        kv_replay_port: int = 0,
        api_server: str | None = None,
        retry_seconds: float = 2.0,
        service_account_dir: Path = SA_DIR,
    ) -> None:
        self.datastore = datastore
        self.pool_name, self.namespace = pool_name, namespace
        self.kv_events_port, self.kv_replay_port = kv_events_port, kv_replay_port
        self.api_server = api_server
        self.service_account_dir = service_account_dir
        self.retry_seconds = retry_seconds
        self.spec: PoolSpec | None = None
        self.pods: dict[str, dict[str, Any]] = {}
        self._spec_changed = asyncio.Event()

    async def run(self) -> None:
        async with _client(self.api_server, self.service_account_dir) as client:
            await asyncio.gather(self._watch_pool(client), self._watch_pods(client))

    def _publish(self) -> None:
        if self.spec is not None:
            self.datastore.set_endpoints(
                endpoints_for(self.pods, self.spec, self.kv_events_port, self.kv_replay_port)
            )

    # -- the InferencePool ------------------------------------------------------------------
    async def _watch_pool(self, client: httpx.AsyncClient) -> None:
        path = f"{POOL_API}/namespaces/{self.namespace}/inferencepools"
        while True:
            try:
                resp = await client.get(f"{path}/{self.pool_name}")
                if resp.status_code == 404:
                    log.warning("InferencePool %s/%s not found; retrying", self.namespace, self.pool_name)
                    await asyncio.sleep(self.retry_seconds)
                    continue
                resp.raise_for_status()
                pool = resp.json()
                self._set_spec(pool)
                version = (pool.get("metadata") or {}).get("resourceVersion", "")
                params = {"watch": "true", "fieldSelector": f"metadata.name={self.pool_name}"}
                if version:
                    params["resourceVersion"] = version
                async with client.stream("GET", path, params=params) as stream:
                    async for line in stream.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if (obj.get("metadata") or {}).get("name") != self.pool_name:
                            continue
                        if event.get("type") == "DELETED":
                            log.warning("InferencePool %s/%s deleted", self.namespace, self.pool_name)
                            self.spec = None
                            self.datastore.set_endpoints([])
                        elif event.get("type") in ("ADDED", "MODIFIED"):
                            self._set_spec(obj)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("InferencePool watch failed: %s; retrying", exc)
            await asyncio.sleep(self.retry_seconds)

    def _set_spec(self, pool: dict[str, Any]) -> None:
        try:
            spec = pool_spec(pool)
        except ValueError as exc:
            # Keep routing by the last good spec (or not at all) rather than by a guess.
            log.warning(
                "InferencePool %s/%s is not a valid v1 pool; ignoring this version: %s",
                self.namespace,
                self.pool_name,
                str(exc).replace("\n", " "),
            )
            return
        if spec != self.spec:
            log.info(
                "InferencePool %s/%s: selector %s ports %s",
                self.namespace,
                self.pool_name,
                spec.match_labels,
                spec.target_ports,
            )
            self.spec = spec
            self._spec_changed.set()
            self._publish()

    # -- the pods ---------------------------------------------------------------------------
    async def _watch_pods(self, client: httpx.AsyncClient) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while True:
            if self.spec is None:
                self._spec_changed.clear()
                await self._spec_changed.wait()
                continue
            spec = self.spec
            self._spec_changed.clear()
            selector = ",".join(f"{k}={v}" for k, v in sorted(spec.match_labels.items()))
            try:
                resp = await client.get(path, params={"labelSelector": selector} if selector else None)
                resp.raise_for_status()
                listing = resp.json()
                self.pods = {p["metadata"]["name"]: p for p in listing.get("items") or []}
                self._publish()
                params = {"watch": "true"}
                if selector:
                    params["labelSelector"] = selector
                version = (listing.get("metadata") or {}).get("resourceVersion")
                if version:
                    params["resourceVersion"] = version
                watch = asyncio.ensure_future(self._consume_pods(client, path, params))
                changed = asyncio.ensure_future(self._spec_changed.wait())
                done, _ = await asyncio.wait({watch, changed}, return_when=asyncio.FIRST_COMPLETED)
                for task in (watch, changed):
                    task.cancel()
                await asyncio.gather(watch, changed, return_exceptions=True)
                if watch in done and not watch.cancelled() and (error := watch.exception()) is not None:
                    raise error
                continue  # the stream ended (API server timeout) or the selector changed: list again
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("pod watch failed: %s; retrying", exc)
            await asyncio.sleep(self.retry_seconds)

    async def _consume_pods(self, client: httpx.AsyncClient, path: str, params: dict[str, str]) -> None:
        async with client.stream("GET", path, params=params) as stream:
            stream.raise_for_status()
            async for line in stream.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ValueError(f"watch error: {pod.get('message', pod)}")
                name = (pod.get("metadata") or {}).get("name")
                if not name:
                    continue
                if kind == "DELETED":
                    self.pods.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    self.pods[name] = pod
                self._publish()

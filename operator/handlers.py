"""The kopf wiring: which events call which reconcile pass, with which credentials.

Handlers are methods of `Operator`, registered by `Operator._register` in the operator's own
`kopf.OperatorRegistry` (no module-level registry), so tests can run several operators, each
against its own API server, in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import kopf

from kvgate.operator.adapter_sync import adapters_gate_pending
from kvgate.operator.children import ANNOTATION_EPP, EPP_MANAGED, LABEL_MD, LABEL_ROLE, MANAGED_BY
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import ApiError, Credentials, KubeClient
from kvgate.operator.reconcile import Event, OwnerGone, Reconciler
from kvgate.operator.resources import DEPLOYMENTS, INFERENCE_POOLS, MODEL_DEPLOYMENTS, PODS
from kvgate.operator.signals import SignalReader

LoginFn = Callable[..., Any]
log = logging.getLogger("kvgate.operator")
PREFIX = "kvgate.dev"

# What each handler watches (kopf's resource and filter arguments).
MD: dict[str, Any] = {
    "group": MODEL_DEPLOYMENTS.group,
    "version": MODEL_DEPLOYMENTS.version,
    "plural": MODEL_DEPLOYMENTS.plural,
}
POOL: dict[str, Any] = {
    "group": INFERENCE_POOLS.group,
    "version": INFERENCE_POOLS.version,
    "plural": INFERENCE_POOLS.plural,
}
PODS_RESOURCE: dict[str, Any] = {"group": PODS.group, "version": PODS.version, "plural": PODS.plural}
MANAGED_POOLS = {ANNOTATION_EPP: EPP_MANAGED}  # hand-made pools whose picker the operator runs
ENGINE_PODS = {LABEL_MD: kopf.PRESENT, LABEL_ROLE: "engine"}
MANAGED_CHILDREN = {LABEL_MD: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGED_BY}


def _handler_id(name: str) -> str:
    """kopf names a handler after its function's qualified name unless given an id, and keeps it
    in objects' annotations (a retried handler's progress), events and logs. These handlers were
    closures in `Operator._register`; they keep the ids they had then."""
    return f"Operator._register.<locals>.{name}"


def _in_cluster_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account, at the address client-go's InClusterConfig uses:
    $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT. kopf's own login dials
    https://kubernetes.default.svc, which needs cluster DNS (a hostNetwork pod, or a node
    without it, has none)."""
    info = kopf.login_with_service_account(**kwargs)
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if info is None or not host:
        return info
    host = f"[{host}]" if ":" in host else host
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return dataclasses.replace(info, server=f"https://{host}:{port}")


def _default_login(**kwargs: Any) -> Any:
    # In a pod: the service account; elsewhere: the current kubeconfig context.
    return _in_cluster_login(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


class Operator:
    def __init__(self, config: OperatorConfig, login: LoginFn | None = None) -> None:
        self.config = config
        self.registry = kopf.OperatorRegistry()
        self._login = login or _default_login
        self._client: KubeClient | None = None
        self._logged_in = asyncio.Event()
        self._reconciler: Reconciler | None = None
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._signals = SignalReader(config.prometheus_url) if config.prometheus_url else None
        self._register()

    # -- plumbing ---------------------------------------------------------------------------

    def _lock(self, kind: str, namespace: str, name: str) -> asyncio.Lock:
        # A change handler and the resync timer may fire together for one object.
        return self._locks.setdefault((kind, namespace, name), asyncio.Lock())

    @property
    def reconciler(self) -> Reconciler:
        if self._reconciler is None:
            raise RuntimeError("the operator has not logged in yet")
        return self._reconciler

    async def _connect(self, info: Any) -> None:
        if self._client is not None:
            await self._client.close()
        self._client = KubeClient(Credentials.from_connection_info(info))
        self._reconciler = Reconciler(self._client, self.config, self._signals)
        self._logged_in.set()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @staticmethod
    def _post(body: Any, events: list[Event]) -> None:
        for ev in events:
            kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)

    # -- handlers ---------------------------------------------------------------------------
    # kopf calls these bound methods; `_register` puts them on this operator's own registry.

    def _register(self) -> None:
        """What kopf's decorators do at module level in its examples, on `self.registry`."""
        reg = self.registry
        resync = {"interval": self.config.resync_seconds, "initial_delay": self.config.resync_seconds}

        kopf.on.startup(registry=reg, id=_handler_id("configure"))(self.configure)
        kopf.on.login(registry=reg, id=_handler_id("login"))(self.login)
        kopf.on.cleanup(registry=reg, id=_handler_id("cleanup"))(self.cleanup)

        md_changed = _handler_id("md_changed")
        kopf.on.update(registry=reg, id=md_changed, **MD)(self.md_changed)
        kopf.on.create(registry=reg, id=md_changed, **MD)(self.md_changed)
        kopf.on.resume(registry=reg, id=md_changed, **MD)(self.md_changed)

        kopf.on.event(registry=reg, labels=ENGINE_PODS, id="engine-pods", **PODS_RESOURCE)(
            self.engine_pod_changed
        )
        for child in (DEPLOYMENTS, INFERENCE_POOLS):
            kopf.on.event(
                registry=reg,
                group=child.group,
                version=child.version,
                plural=child.plural,
                labels=MANAGED_CHILDREN,
                id=f"child-{child.plural}",
            )(self.child_changed)

        kopf.timer(registry=reg, id=_handler_id("md_resync"), **resync, **MD)(self.md_resync)

        pool_changed = _handler_id("pool_changed")
        kopf.on.update(registry=reg, id=pool_changed, annotations=MANAGED_POOLS, **POOL)(self.pool_changed)
        kopf.on.create(registry=reg, id=pool_changed, annotations=MANAGED_POOLS, **POOL)(self.pool_changed)
        kopf.on.resume(registry=reg, id=pool_changed, annotations=MANAGED_POOLS, **POOL)(self.pool_changed)

        kopf.timer(registry=reg, id=_handler_id("pool_resync"), annotations=MANAGED_POOLS, **resync, **POOL)(
            self.pool_resync
        )

    def configure(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = f"{PREFIX}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=PREFIX, key="last-handled-configuration"
        )
        # kopf's per-handler success events are noise; ours (and failures) still post.
        settings.posting.level = logging.WARNING
        settings.scanning.disabled = not self.config.scanning
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60

    async def login(self, **kwargs: Any) -> Any:
        info = self._login(**kwargs)
        if asyncio.iscoroutine(info):
            info = await info
        if info is not None:
            await self._connect(info)
        return info

    async def cleanup(self, **_: Any) -> None:
        await self.close()

    async def _reconcile_md(self, body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
        meta = body.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return  # children go with the owner (garbage collection); do not recreate them
        namespace, name = meta["namespace"], meta["name"]
        async with self._lock("md", namespace, name):
            # Reconcile the object as it is now, not as kopf saw it when this handler was
            # called: a pass waits here behind others (child events, the resync), and one
            # that applied its older spec would undo the edits they applied meanwhile.
            current = await self.reconciler.client.get(MODEL_DEPLOYMENTS, namespace, name)
            current_meta = (current or {}).get("metadata") or {}
            if current is None or current_meta.get("uid") != meta.get("uid"):
                return  # deleted (or replaced: the new object's own handlers see to it)
            if current_meta.get("deletionTimestamp"):
                return
            try:
                outcome = await self.reconciler.reconcile_model_deployment(current)
            except OwnerGone:
                return
        for key, value in outcome.status.items():
            patch.status[key] = value
        self._post(body, outcome.events)

    async def md_changed(self, body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        await self._reconcile_md(body, patch, logger)

    async def md_resync(self, body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        await self._reconcile_md(body, patch, logger)

    async def child_changed(self, event: dict[str, Any], **_: Any) -> None:
        # A child's status moved (pods became ready, the gateway accepted the pool) or someone
        # edited or deleted it: refresh the owner now instead of at the next resync.
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(LABEL_MD)
        if not owner or self._reconciler is None:
            return
        namespace = meta["namespace"]
        client = self.reconciler.client
        async with self._lock("md", namespace, owner):
            # Read the owner once the pass ahead of this one is done: read before the wait, it
            # may predate an edit that pass applied, and this pass would undo it.
            body = await client.get(MODEL_DEPLOYMENTS, namespace, owner)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            try:
                outcome = await self.reconciler.reconcile_model_deployment(body)
                await client.patch(MODEL_DEPLOYMENTS, namespace, owner, {"status": outcome.status}, "status")
            except OwnerGone:
                return
            except ApiError as exc:
                if exc.status == 404:  # deleted meanwhile
                    return
                raise
        self._post(body, outcome.events)

    async def engine_pod_changed(self, event: dict[str, Any], **_: Any) -> None:
        # A LoRA engine pod whose engine just came up waits on our readiness gate: load its
        # adapters now rather than at the next resync (its Deployment's status has not moved).
        if adapters_gate_pending(event.get("object") or {}):
            await self.child_changed(event)

    async def _reconcile_pool(self, body: kopf.Body) -> None:
        meta = body.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return
        async with self._lock("pool", meta["namespace"], meta["name"]):
            try:
                events = await self.reconciler.reconcile_managed_pool(dict(body))
            except OwnerGone:
                return
        self._post(body, events)

    async def pool_changed(self, body: kopf.Body, **_: Any) -> None:
        await self._reconcile_pool(body)

    async def pool_resync(self, body: kopf.Body, **_: Any) -> None:
        await self._reconcile_pool(body)

    # -- running ----------------------------------------------------------------------------

    async def _serve_metrics_api(self) -> None:
        """The External Metrics API, once logged in (it reads through the operator's client)."""
        from kvgate.operator.metrics_api import ExternalMetricsApi

        await self._logged_in.wait()
        api = ExternalMetricsApi(lambda: self._client, self.config.metrics_api_port)
        try:
            await api.start()
            await asyncio.Event().wait()
        except Exception as exc:  # the operator goes on reconciling; the HPAs see no metric
            log.error("the External Metrics API cannot serve: %s", exc)
        finally:
            await api.close()

    async def run(self, stop_flag: Any = None, ready_flag: Any = None) -> None:
        metrics_api = asyncio.create_task(self._serve_metrics_api()) if self.config.metrics_api_port else None
        try:
            await kopf.operator(
                registry=self.registry,
                standalone=self.config.standalone,
                clusterwide=self.config.all_namespaces,
                namespaces=list(self.config.namespaces),
                liveness_endpoint=self.config.liveness_endpoint,
                stop_flag=stop_flag,
                ready_flag=ready_flag,
            )
        finally:
            if metrics_api is not None:
                metrics_api.cancel()
                await asyncio.gather(metrics_api, return_exceptions=True)
            await self.close()

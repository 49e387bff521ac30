"""The External Metrics API (external.metrics.k8s.io/v1beta1) behind the HPAs the operator
writes, served by the operator itself (`kvgate operator run --metrics-api-port`, the chart's
`metricsApi.enabled`): an HPA on a pool's queue then needs no Prometheus, prometheus-adapter or
KEDA.

The kube-apiserver's aggregation layer authenticates and authorizes the caller (the HPA
controller, `kubectl get --raw`) and forwards the request through an APIService with its
front-proxy client certificate. Only that certificate is accepted here: the requestheader CA and
allowed names the API server publishes in kube-system/extension-apiserver-authentication.

A value is read when it is asked for, from the pool's endpoint-picker replicas: each Ready EPP
pod's /metrics (GIE's pool gauges, labelled name=<pool>), the max over replicas as the
ScaledObject's PromQL takes it. No EPP answering means no value, and the HPA keeps its count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.api.contracts import prometheus_text
from kvgate.api.contracts.metrics import (
    LABEL_POOL_NAME,
    POOL_AVERAGE_KV_CACHE_UTILIZATION,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_SATURATION,
    saturation,
)
from kvgate.api.tls import self_signed_cert
from kvgate.operator.adapter_sync import url_host
from kvgate.operator.children.common import EPP_METRICS_PORT
from kvgate.operator.kube import KubeClient
from kvgate.operator.resources import CONFIG_MAPS, INFERENCE_POOLS, PODS, SERVICES

log = logging.getLogger("kvgate.operator.metrics_api")

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
PREFIX = f"/apis/{GROUP_VERSION}"
METRICS = (POOL_AVERAGE_QUEUE_SIZE, POOL_AVERAGE_KV_CACHE_UTILIZATION, POOL_SATURATION)
SCRAPE_TIMEOUT_S = 3.0


def pool_gauges(text: str, pool: str) -> dict[str, float]:
    """GIE's pool gauges for `pool` in one EPP's Prometheus text exposition."""
    out: dict[str, float] = {}
    wanted = (POOL_AVERAGE_QUEUE_SIZE, POOL_AVERAGE_KV_CACHE_UTILIZATION)
    for name, raw_labels, value in prometheus_text.samples(text, wanted, prefixes=wanted):
        if prometheus_text.labels(raw_labels).get(LABEL_POOL_NAME) == pool:
            out[name] = value
    return out


def pool_of(selector: str) -> str | None:
    """The pool an HPA's metric selector names (`name=<pool>`, as the operator writes it)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        if sep and key.strip() == LABEL_POOL_NAME and value.strip():
            return value.strip()
    return None


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole units when exact, else milli-units (as metrics adapters send)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}  # fmt: skip
    return web.json_response(body, status=code)


class ExternalMetricsApi:
    def __init__(self, client: Callable[[], KubeClient | None], port: int, host: str = "0.0.0.0") -> None:
        self._client, self.port, self.host = client, port, host
        self._runner: web.AppRunner | None = None
        self._allowed_names: list[str] = []
        self._http: aiohttp.ClientSession | None = None

    # -- serving -----------------------------------------------------------------------------
    async def start(self) -> None:
        ca, self._allowed_names = await self._front_proxy_trust()
        folder = Path(tempfile.mkdtemp(prefix="kvgate-metrics-api-"))
        cert, key = self_signed_cert(("localhost",))
        (folder / "tls.crt").write_bytes(cert)
        (folder / "tls.key").write_bytes(key)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(folder / "tls.crt", folder / "tls.key")
        (folder / "tls.key").unlink()
        ctx.verify_mode = ssl.CERT_REQUIRED  # the aggregator's front-proxy certificate, nothing else
        ctx.load_verify_locations(cadata=ca)
        app = web.Application()
        app.router.add_get(PREFIX, self._discovery)
        app.router.add_get(PREFIX + "/namespaces/{namespace}/{metric}", self._value)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=ctx).start()
        log.info("External Metrics API (%s) serving on %s:%d", GROUP_VERSION, self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _front_proxy_trust(self) -> tuple[str, list[str]]:
        client = self._client()
        assert client is not None
        cm = await client.get(CONFIG_MAPS, "kube-system", "extension-apiserver-authentication")
        data = (cm or {}).get("data") or {}
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise RuntimeError(
                "the API server publishes no front-proxy CA (requestheader-client-ca-file in "
                "kube-system/extension-apiserver-authentication): it cannot call an aggregated API"
            )
        return ca, list(json.loads(data.get("requestheader-allowed-names") or "[]"))

    def _caller_allowed(self, request: web.Request) -> bool:
        if not self._allowed_names:
            return True  # any certificate the front-proxy CA signed (the API server's own rule)
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(item for rdn in (peer or {}).get("subject", ()) for item in rdn)
        return subject.get("commonName") in self._allowed_names

    async def _discovery(self, request: web.Request) -> web.Response:
        if not self._caller_allowed(request):
            return _status(403, "Forbidden", "not the API server's front proxy")
        resources = [{"name": m, "singularName": "", "namespaced": True, "kind": "ExternalMetricValueList",
                      "verbs": ["get"]} for m in METRICS]  # fmt: skip
        return web.json_response({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION,
                                  "resources": resources})  # fmt: skip

    async def _value(self, request: web.Request) -> web.Response:
        if not self._caller_allowed(request):
            return _status(403, "Forbidden", "not the API server's front proxy")
        namespace, metric = request.match_info["namespace"], request.match_info["metric"]
        if metric not in METRICS:
            return _status(404, "NotFound", f"no external metric {metric!r}; served: {', '.join(METRICS)}")
        pool = pool_of(request.query.get("labelSelector", ""))
        if pool is None:
            return _status(400, "BadRequest", f"labelSelector must name the pool: {LABEL_POOL_NAME}=<pool>")
        value = await self.read(namespace, pool, metric)
        items = []
        if value is not None:
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            items.append({"metricName": metric, "metricLabels": {LABEL_POOL_NAME: pool}, "timestamp": stamp,
                          "value": quantity(value)})  # fmt: skip
        return web.json_response({"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION,
                                  "metadata": {}, "items": items})  # fmt: skip

    # -- reading -----------------------------------------------------------------------------
    async def read(self, namespace: str, pool: str, metric: str) -> float | None:
        """The metric for one pool now, from its EPP replicas (max over them); None if none answers."""
        gauges = await self._scrape(namespace, pool)
        if not gauges:
            return None
        queue = max((g.get(POOL_AVERAGE_QUEUE_SIZE, 0.0) for g in gauges), default=0.0)
        kv = max((g.get(POOL_AVERAGE_KV_CACHE_UTILIZATION, 0.0) for g in gauges), default=0.0)
        if metric == POOL_AVERAGE_QUEUE_SIZE:
            return queue
        if metric == POOL_AVERAGE_KV_CACHE_UTILIZATION:
            return kv
        return saturation(queue, kv)

    async def _scrape(self, namespace: str, pool: str) -> list[dict[str, float]]:
        client = self._client()
        if client is None or self._http is None:
            return []
        pool_obj = await client.get(INFERENCE_POOLS, namespace, pool)
        ref = ((pool_obj or {}).get("spec") or {}).get("endpointPickerRef") or {}
        service = await client.get(SERVICES, namespace, ref["name"]) if ref.get("name") else None
        selector = ((service or {}).get("spec") or {}).get("selector") or {}
        if not selector:
            return []
        pods = await client.list(PODS, namespace, ",".join(f"{k}={v}" for k, v in sorted(selector.items())))
        urls = [
            f"http://{url_host(ip)}:{_metrics_port(p)}/metrics" for p in pods if _ready(p) and (ip := _ip(p))
        ]
        texts = await asyncio.gather(*(self._get(u) for u in urls))
        return [g for text in texts if text is not None and (g := pool_gauges(text, pool))]

    async def _get(self, url: str) -> str | None:
        assert self._http is not None
        try:
            async with self._http.get(url) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("scraping %s failed: %s", url, exc)
            return None


def _ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _ip(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("podIP") or "")


def _metrics_port(pod: dict[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics":
                return int(port["containerPort"])
    return EPP_METRICS_PORT

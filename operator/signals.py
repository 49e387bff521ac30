"""Reads each pool's live queue and saturation from Prometheus (prometheus-api-client).

The EPP exports GIE's pool gauges (`inference_pool_average_queue_size{name=<pool>}`,
`inference_pool_average_kv_cache_utilization`); where those are missing (no EPP scraped yet),
the engines' own vLLM gauges for the served model stand in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvgate.api.contracts.metrics import (
    KV_CACHE_USAGE_PERC,
    LABEL_MODEL_NAME,
    NUM_REQUESTS_WAITING,
    POOL_AVERAGE_KV_CACHE_UTILIZATION,
    POOL_AVERAGE_QUEUE_SIZE,
    saturation,
)
from kvgate.operator.children import pool_gauge


@dataclass(frozen=True)
class Signals:
    queue_size: float | None
    kv_cache_utilization: float | None
    source: str  # "epp", "engines" or "none"

    @property
    def saturation(self) -> float | None:
        if self.queue_size is None and self.kv_cache_utilization is None:
            return None
        # A missing part counts as 0: both parts are non-negative, so the max is the known one.
        return saturation(self.queue_size or 0.0, self.kv_cache_utilization or 0.0)


@dataclass(frozen=True)
class QueryCheck:
    has_data: bool
    error: str | None = None


class PrometheusUnavailable(Exception):
    pass


class SignalReader:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        from prometheus_api_client import PrometheusConnect  # lazy: only with --prometheus-url
        from urllib3.util.retry import Retry

        self.url = url
        # Short timeouts and one quick retry: a slow or absent Prometheus must not stall resyncs
        # (the client's default retries with backoff for many seconds).
        retry = Retry(total=1, backoff_factor=0.1, status_forcelist=(502, 503, 504))
        self._prom = PrometheusConnect(url=url, disable_ssl=True, retry=retry, timeout=timeout_s)
        self._timeout_ms = int(timeout_s * 1000)

    def _scalar(self, query: str) -> float | None:
        try:
            result = self._prom.custom_query(query, params={"timeout": f"{self._timeout_ms}ms"})
        except Exception as exc:  # the client raises several types for one cause: no answer
            raise PrometheusUnavailable(f"{self.url}: {exc}") from exc
        if not result:
            return None
        try:
            return float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            return None

    def _read(self, pool: str, served_name: str) -> Signals:
        queue = self._scalar(pool_gauge(POOL_AVERAGE_QUEUE_SIZE, pool))
        kv = self._scalar(pool_gauge(POOL_AVERAGE_KV_CACHE_UTILIZATION, pool))
        if queue is not None or kv is not None:
            return Signals(queue, kv, "epp")
        model = f'{{{LABEL_MODEL_NAME}="{served_name}"}}'
        queue = self._scalar(f"avg({NUM_REQUESTS_WAITING}{model})")
        kv = self._scalar(f"avg({KV_CACHE_USAGE_PERC}{model})")
        return Signals(queue, kv, "engines" if queue is not None or kv is not None else "none")

    def _check(self, query: str) -> QueryCheck:
        try:
            return QueryCheck(self._scalar(query) is not None)
        except PrometheusUnavailable as exc:
            return QueryCheck(False, str(exc))

    async def read(self, pool: str, served_name: str) -> Signals:
        return await asyncio.to_thread(self._read, pool, served_name)

    async def check(self, query: str) -> QueryCheck:
        return await asyncio.to_thread(self._check, query)

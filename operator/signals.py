"""Reads each pool's live queue and saturation from Prometheus (prometheus-api-client).

The EPP exports GIE's pool gauges (`inference_pool_average_queue_size{name=<pool>}`,
`inference_pool_average_kv_cache_utilization`); where those are missing (no EPP scraped yet),
the engines' own vLLM gauges for the served model stand in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvgate.operator.children import KV_SATURATION, POOL_KV_METRIC, POOL_QUEUE_METRIC, QUEUE_SATURATION


@dataclass(frozen=True)
class Signals:
    queue_size: float | None
    kv_cache_utilization: float | None
    source: str  # "epp", "engines" or "none"

    @property
    def saturation(self) -> float | None:
        parts = []
        if self.queue_size is not None:
            parts.append(self.queue_size / QUEUE_SATURATION)
        if self.kv_cache_utilization is not None:
            parts.append(self.kv_cache_utilization / KV_SATURATION)
        return max(parts) if parts else None


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
        queue = self._scalar(f'max({POOL_QUEUE_METRIC}{{name="{pool}"}})')
        kv = self._scalar(f'max({POOL_KV_METRIC}{{name="{pool}"}})')
        if queue is not None or kv is not None:
            return Signals(queue, kv, "epp")
        queue = self._scalar(f'avg(vllm:num_requests_waiting{{model_name="{served_name}"}})')
        kv = self._scalar(f'avg(vllm:kv_cache_usage_perc{{model_name="{served_name}"}})')
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

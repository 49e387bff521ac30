"""The EPP's Prometheus metrics, in GIE's ``inference_objective_*`` / ``inference_pool_*`` family."""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.api.contracts.metrics import (
    LABEL_MODEL_SERVER_POD,
    LABEL_POOL_NAME,
    POOL_AVERAGE_KV_CACHE_UTILIZATION,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_PER_POD_QUEUE_SIZE,
    POOL_READY_PODS,
)
from kvgate.epp.datastore import Datastore

_LATENCY_BUCKETS = (
    0.005,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    1.25,
    1.5,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    120,
    180,
    240,
    300,
    360,
    480,
    600,
    900,
    1200,
    1800,
    2700,
    3600,
)
_SCHEDULER_BUCKETS = (
    0.00001,
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
)


class _PoolCollector(Collector):
    """Pool gauges computed at scrape time from the datastore (no bookkeeping on the hot path)."""

    def __init__(self, datastore: Datastore, pool_name: str) -> None:
        self.datastore = datastore
        self.pool_name = pool_name

    def collect(self):
        states = [s for s in self.datastore.all() if self.datastore.reachable(s)]
        n = len(states)
        pool = [LABEL_POOL_NAME]
        ready = GaugeMetricFamily(POOL_READY_PODS, "Ready endpoints in the pool", labels=pool)
        ready.add_metric([self.pool_name], n)
        kv = GaugeMetricFamily(
            POOL_AVERAGE_KV_CACHE_UTILIZATION, "Mean KV-cache use over the pool (0-1)", labels=pool
        )
        kv.add_metric([self.pool_name], sum(s.metrics.kv_usage for s in states) / n if n else 0.0)
        queue = GaugeMetricFamily(POOL_AVERAGE_QUEUE_SIZE, "Mean waiting queue over the pool", labels=pool)
        queue.add_metric([self.pool_name], sum(s.metrics.waiting for s in states) / n if n else 0.0)
        per_pod = GaugeMetricFamily(
            POOL_PER_POD_QUEUE_SIZE, "Waiting queue per endpoint", labels=[*pool, LABEL_MODEL_SERVER_POD]
        )
        for s in states:
            per_pod.add_metric([self.pool_name, s.endpoint.name or s.address], s.metrics.waiting)
        blocks = GaugeMetricFamily(
            "kvgate_epp_prefix_index_blocks",
            "KV blocks the precise prefix index holds per endpoint (from KV events)",
            labels=[*pool, "endpoint", "kv_events_live"],
        )
        for s in self.datastore.all():
            blocks.add_metric(
                [self.pool_name, s.address, str(s.kv_events_live).lower()],
                self.datastore.index.block_count(s.address),
            )
        # Signal freshness for dashboards and alerts (read at scrape time, off the pick path):
        # how old each endpoint's last scraped metrics are, and whether its KV events are live.
        now = time.monotonic()
        age = GaugeMetricFamily(
            "kvgate_epp_endpoint_metrics_age_seconds",
            "Seconds since the endpoint's /metrics were last scraped successfully (-1: never)",
            labels=[*pool, "endpoint"],
        )
        live = GaugeMetricFamily(
            "kvgate_epp_kv_events_live",
            "1 while the endpoint's KV-event subscription is connected and in sequence",
            labels=[*pool, "endpoint"],
        )
        for s in self.datastore.all():
            seconds = s.age(now)
            age.add_metric([self.pool_name, s.address], -1.0 if math.isinf(seconds) else seconds)
            live.add_metric([self.pool_name, s.address], 1.0 if s.kv_events_live else 0.0)
        yield from (ready, kv, queue, per_pod, blocks, age, live)


UNKNOWN_MODEL = "unknown"  # the label of every model name the pool does not serve
MAX_MODEL_LABELS = 64  # backstop when the pool reports no names


class ModelLabels:
    """Model names come from clients: as metric labels they must be bounded, or 3,000 random
    names grow /metrics to 61 MB. A name the pool serves (GET /v1/models on its engines) or
    was configured with is its own label; anything else is `unknown`. Until the pool reports
    its names, the first MAX_MODEL_LABELS names seen are kept, then `unknown`."""

    def __init__(self, datastore: Datastore, configured: frozenset[str] = frozenset()) -> None:
        self.datastore = datastore
        self.configured = configured
        self._admitted: set[str] = set()

    def __call__(self, name: str) -> str:
        if not name or name in self._admitted:
            return name
        known = self.datastore.known_models()
        if name in known or name in self.configured or (not known and len(self._admitted) < MAX_MODEL_LABELS):
            if len(self._admitted) < 4 * MAX_MODEL_LABELS:
                self._admitted.add(name)
                return name
        return UNKNOWN_MODEL


class EppMetrics:
    def __init__(self, datastore: Datastore, pool_name: str = "local") -> None:
        self.model_label = ModelLabels(datastore)
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model_name", "target_model_name"]
        self.requests = Counter("inference_objective_request", "Requests received", labels, registry=r)
        self.errors = Counter(
            "inference_objective_request_error", "Requests that failed", [*labels, "error_code"], registry=r
        )
        self.duration = Histogram(
            "inference_objective_request_duration_seconds",
            "End-to-end request latency seen by the EPP",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "inference_objective_running_requests", "Requests in flight", ["model_name"], registry=r
        )
        self.request_sizes = Histogram(
            "inference_objective_request_sizes",
            "Request body size in bytes",
            labels,
            buckets=(64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304),
            registry=r,
        )
        self.scheduler = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time spent choosing an endpoint",
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.plugin = Histogram(
            "inference_extension_plugin_duration_seconds",
            "Time spent in each scheduling plugin",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.endpoint_errors = Counter(
            "inference_pool_endpoint_error",
            "Non-200 upstream responses per endpoint",
            ["name", "endpoint"],
            registry=r,
        )
        self.pd_decisions = Counter(
            "kvgate_epp_pd_decisions",
            "Prefill/decode decisions (only with --pd-threshold): disaggregated (a prefill engine "
            "named in x-prefiller-host-port) or aggregated, and why",
            ["decision", "reason"],
            registry=r,
        )
        self.pool_name = pool_name
        r.register(_PoolCollector(datastore, pool_name))
        self._plugin_children: dict[str, Histogram] = {}

    def describe_plugins(self, plugins: dict[str, tuple[str, str]]) -> None:
        """plugin name -> (extension point, type): resolved once, not per request."""
        self._plugin_children = {
            name: self.plugin.labels(point, type_name, name) for name, (point, type_name) in plugins.items()
        }

    def observe_plugin(self, name: str, seconds: float) -> None:
        child = self._plugin_children.get(name)
        if child is None:
            child = self._plugin_children[name] = self.plugin.labels("", "", name)
        child.observe(seconds)

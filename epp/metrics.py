"""The EPP's Prometheus metrics, in GIE's ``inference_objective_*`` / ``inference_pool_*`` family."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from kvgate.epp.flow_control import FlowController, FlowKey

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


# Flow control, in GIE's names where GIE has the metric (its pkg/epp/metrics/metrics.go:
# inference_extension_flow_control_*, labels fairness_id, priority, inference_pool), else kvgate's.
FLOW_QUEUE_DURATION = "inference_extension_flow_control_request_queue_duration_seconds"
FLOW_QUEUE_SIZE = "inference_extension_flow_control_queue_size"
FLOW_QUEUE_BYTES = "inference_extension_flow_control_queue_bytes"
FLOW_REJECTIONS = "kvgate_epp_flow_control_rejections"  # exported with _total
FLOW_SERVICE_TOKENS = "kvgate_epp_flow_control_tenant_service_tokens"  # exported with _total
FLOW_REFUNDED_TOKENS = "kvgate_epp_flow_control_tenant_refunded_tokens"  # exported with _total
LABEL_FAIRNESS_ID = "fairness_id"
LABEL_PRIORITY = "priority"
LABEL_INFERENCE_POOL = "inference_pool"
OUTCOME_DISPATCHED = "Dispatched"  # GIE's QueueOutcome for a dispatched request
# GIE's buckets for the queue duration
_FLOW_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Reasons a held request is answered 429/503 (kvgate.epp.flow_control); a flow's ttl_expired
# series is created at 0 when the flow is first seen, so `increase()` counts its first expiry.
TTL_EXPIRED = "ttl_expired"

OTHER_FAIRNESS_ID = "other"  # the label of every fairness id past MAX_FAIRNESS_LABELS
MAX_FAIRNESS_LABELS = 100


class FairnessLabels:
    """Fairness ids label metrics, and without a tenants file they come from a client header:
    the first MAX_FAIRNESS_LABELS ids seen (and the configured tenants, always) are their own
    label; any other is `other`."""

    def __init__(self, limit: int = MAX_FAIRNESS_LABELS) -> None:
        self.limit = limit
        self._admitted: set[str] = set()
        self._configured: set[str] = set()

    def configure(self, names: Iterable[str]) -> None:
        self._configured |= set(names)

    def __call__(self, fairness_id: str) -> str:
        if fairness_id in self._admitted or fairness_id in self._configured:
            return fairness_id
        if len(self._admitted) < self.limit:
            self._admitted.add(fairness_id)
            return fairness_id
        return OTHER_FAIRNESS_ID


class _FlowCollector(Collector):
    """Queue size per flow and queued bytes, read from the controller at scrape time. A flow
    seen once stays exported (0 while empty), so its graph drops to 0 instead of ending."""

    def __init__(self, metrics: EppMetrics) -> None:
        self.metrics = metrics
        self.controller: FlowController | None = None  # set by EppMetrics.watch_flow_control

    def collect(self):
        m = self.metrics
        controller = self.controller
        if controller is None:
            return
        # Scrapes run on the metrics server's thread while the controller changes on the event
        # loop: a read that met a change is retried (the counts are a moment's anyway).
        queued: dict[FlowKey, int] = {}
        for _ in range(5):
            try:
                queued = dict(controller.queue_sizes())
                break
            except RuntimeError:  # a dict changed size while it was read
                continue
        sizes: dict[tuple[str, str], int] = {}
        for key, n in queued.items():
            labels = m._flow_labels(key)
            sizes[labels] = sizes.get(labels, 0) + n
        with m._flow_lock:
            for labels in m._flows:
                sizes.setdefault(labels, 0)
        pool = m.pool_name
        size = GaugeMetricFamily(
            FLOW_QUEUE_SIZE,
            "Requests held in the EPP's flow-control queues, per flow",
            labels=[LABEL_FAIRNESS_ID, LABEL_PRIORITY, LABEL_INFERENCE_POOL],
        )
        for (fairness_id, priority), n in sorted(sizes.items()):
            size.add_metric([fairness_id, priority, pool], n)
        held = GaugeMetricFamily(
            FLOW_QUEUE_BYTES,
            "Request bodies held in the EPP's flow-control queues, in bytes (all flows)",
            labels=[LABEL_INFERENCE_POOL],
        )
        held.add_metric([pool], controller.queued_bytes)
        yield from (size, held)


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
        # Flow control: exported once watch_flow_control names the controller.
        self.fairness_label = FairnessLabels()
        self._flows: set[tuple[str, str]] = set()  # (fairness_id, priority) labels seen
        self._flow_lock = threading.Lock()  # events on the event loop, scrapes on their thread
        # Registered before the flow counters: the flows it finds get their ttl_expired series
        # (at 0) in time for the same scrape.
        self._flow_collector = _FlowCollector(self)
        r.register(self._flow_collector)
        flow = [LABEL_FAIRNESS_ID, LABEL_PRIORITY]
        self.flow_queue_duration = Histogram(
            FLOW_QUEUE_DURATION,
            "Time requests spent held in the EPP's flow-control queues before their dispatch "
            "(outcome Dispatched; its _count: the requests dispatched)",
            [*flow, "outcome", LABEL_INFERENCE_POOL],
            buckets=_FLOW_QUEUE_BUCKETS,
            registry=r,
        )
        self.flow_rejections = Counter(
            FLOW_REJECTIONS,
            "Requests flow control answered 429/503 instead of dispatching, by reason: "
            "ttl_expired, queue_full, flow_queue_full, pick_<status>",
            [*flow, "reason", LABEL_INFERENCE_POOL],
            registry=r,
        )
        self.flow_service = Counter(
            FLOW_SERVICE_TOKENS,
            "Service this replica charged each tenant in fair shares (weighted tokens: prompt "
            "plus weighted output, the output estimated at dispatch); net service: this minus "
            + FLOW_REFUNDED_TOKENS
            + "_total",
            [LABEL_FAIRNESS_ID, LABEL_INFERENCE_POOL],
            registry=r,
        )
        self.flow_refunded = Counter(
            FLOW_REFUNDED_TOKENS,
            "Weighted tokens given back to each tenant when a request produced less output than "
            "its dispatch estimate",
            [LABEL_FAIRNESS_ID, LABEL_INFERENCE_POOL],
            registry=r,
        )

    # -- flow control (kvgate.epp.flow_control.FlowObserver) --------------------------------
    def watch_flow_control(self, controller: FlowController, tenants: Iterable[str] = ()) -> None:
        """Export `controller`'s queues and outcomes: become its observer, read its queues at
        scrape time, and count the service it charges (chained after an `on_charge` already
        set; one set later must chain this one). `tenants`: configured names, always labelled
        as themselves."""
        self.fairness_label.configure(tenants)
        controller.observer = self
        previous: Callable[[str, float], None] | None = controller.on_charge

        def on_charge(tenant: str, tokens: float) -> None:
            self.charged(tenant, tokens)
            if previous is not None:
                previous(tenant, tokens)

        controller.on_charge = on_charge
        self._flow_collector.controller = controller

    def _flow_labels(self, key: FlowKey) -> tuple[str, str]:
        with self._flow_lock:
            labels = (self.fairness_label(key.fairness_id), str(key.priority))
            if labels not in self._flows:
                self._flows.add(labels)
                self.flow_rejections.labels(*labels, TTL_EXPIRED, self.pool_name)  # starts at 0
            return labels

    def dispatched(self, key: FlowKey, queued_seconds: float) -> None:
        fairness_id, priority = self._flow_labels(key)
        self.flow_queue_duration.labels(fairness_id, priority, OUTCOME_DISPATCHED, self.pool_name).observe(
            max(0.0, queued_seconds)
        )

    def rejected(self, key: FlowKey, reason: str) -> None:
        fairness_id, priority = self._flow_labels(key)
        self.flow_rejections.labels(fairness_id, priority, reason, self.pool_name).inc()

    def charged(self, tenant: str, tokens: float) -> None:
        if not math.isfinite(tokens) or tokens == 0:
            return
        with self._flow_lock:
            label = self.fairness_label(tenant)
        counter = self.flow_service if tokens > 0 else self.flow_refunded
        counter.labels(label, self.pool_name).inc(abs(tokens))

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

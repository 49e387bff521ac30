"""The batch service's Prometheus metrics (`GET /metrics` on its own port).

Counters and histograms are this replica's (sum them over replicas); the per-batch gauges are
read from the database at scrape time, so every replica reports the same figures for a batch:
its lines by state, its lines per second since it started and the time left at that rate.
Only batches still running are labelled, so the label set stays as small as the work in hand.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.batch.progress import progress
from kvgate.batch.store import IN_PROGRESS, Store

# Lines wait behind online traffic for minutes and run for seconds: buckets up to a day.
QUEUE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _BatchGauges(Collector):
    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lines = GaugeMetricFamily(
            "kvgate_batch_requests", "Lines of a running batch, by state", labels=["batch_id", "state"]
        )
        rate = GaugeMetricFamily(
            "kvgate_batch_throughput_lines_per_second",
            "Lines a running batch finished per second since it started",
            labels=["batch_id"],
        )
        eta = GaugeMetricFamily(
            "kvgate_batch_eta_seconds",
            "Seconds a running batch needs at its rate so far",
            labels=["batch_id"],
        )
        now = self.clock()
        for row in self.store.batches_in(IN_PROGRESS):
            c = self.store.counts(row.id)
            p = progress(c.total, c.completed, c.failed, row.in_progress_at, now)
            pending = c.total - c.completed - c.failed
            for state, n in (
                ("total", c.total),
                ("completed", c.completed),
                ("failed", c.failed),
                ("pending", pending),
            ):
                lines.add_metric([row.id, state], n)
            if p.lines_per_s is not None and p.eta_s is not None:
                rate.add_metric([row.id], p.lines_per_s)
                eta.add_metric([row.id], p.eta_s)
        yield from (lines, rate, eta)


class BatchMetrics:
    """One registry per service (no process-global state)."""

    def __init__(self, store: Store | None = None, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lines = Counter(
            "kvgate_batch_lines", "Lines this replica finished, by outcome", ["outcome"], registry=r
        )
        self.attempts = Counter(
            "kvgate_batch_attempts",
            "Lines this replica sent to the gateway, by result: ok, refused (429/503, sent again "
            "later), error (retried or failed)",
            ["result"],
            registry=r,
        )
        self.output_tokens = Counter(
            "kvgate_batch_output_tokens", "Completion tokens of the lines this replica finished", registry=r
        )
        self.queue_seconds = Histogram(
            "kvgate_batch_line_queue_seconds",
            "From a batch's creation to its line's first send the pool took (refusals count as waiting)",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.duration_seconds = Histogram(
            "kvgate_batch_line_duration_seconds",
            "A line's request through the gateway, answered",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.concurrency = Gauge(
            "kvgate_batch_concurrency_limit", "Lines this replica may have in flight now (AIMD)", registry=r
        )
        self.in_flight = Gauge("kvgate_batch_in_flight", "Lines this replica is sending now", registry=r)
        for outcome in ("completed", "failed"):
            self.lines.labels(outcome)
        for result in ("ok", "refused", "error"):
            self.attempts.labels(result)
        if store is not None:
            r.register(_BatchGauges(store, clock))


def completion_tokens(body: str) -> int:
    """usage.completion_tokens of an OpenAI response body (0 where it says none)."""
    try:
        usage = json.loads(body).get("usage") or {}
        return max(0, int(usage.get("completion_tokens") or 0))
    except (ValueError, TypeError, AttributeError):
        return 0

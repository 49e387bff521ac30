"""fresh-metrics-filter (kvgate.epp.scheduling.plugins.fresh_metrics_filter)."""

from __future__ import annotations

import time

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.fresh_metrics_filter import FreshMetricsFilter
from kvgate.testing.scheduling import ctx_for


def test_fresh_metrics_filter_drops_stale(store: Datastore) -> None:
    a, b, c = store.all()
    b.metrics.updated_at = time.monotonic() - 10
    c.metrics.updated_at = 0.0
    assert FreshMetricsFilter(staleness_seconds=2).filter(ctx_for(store), store.all()) == [a]

"""least-queue-filter (kvgate.epp.scheduling.plugins.least_queue_filter)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.least_queue_filter import LeastQueueFilter
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_least_queue_filter_keeps_lowest_band(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, waiting=0, kv_usage=0.1)
    set_metrics(store, b, waiting=1, kv_usage=0.9)
    set_metrics(store, c, waiting=9, kv_usage=0.5)
    ctx = ctx_for(store)
    assert [e.address for e in LeastQueueFilter().filter(ctx, store.all())] == [a, b]

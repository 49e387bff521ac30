"""low-queue-filter (kvgate.epp.scheduling.plugins.low_queue_filter)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.low_queue_filter import LowQueueFilter
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_low_queue_filter(store: Datastore) -> None:
    a, b, _ = (s.address for s in store.all())
    set_metrics(store, a, waiting=3)
    set_metrics(store, b, waiting=200)
    kept = LowQueueFilter(threshold=128).filter(ctx_for(store), store.all())
    assert [e.address for e in kept] == [a, store.all()[2].address]

"""queue-scorer (kvgate.epp.scheduling.plugins.queue_scorer)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.queue_scorer import QueueScorer
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_queue_scorer_min_max(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, waiting=0)
    set_metrics(store, b, waiting=5)
    set_metrics(store, c, waiting=10)
    assert QueueScorer().score(ctx_for(store), store.all()) == [1.0, 0.5, 0.0]
    for s in store.all():
        s.metrics.waiting = 4
    assert QueueScorer().score(ctx_for(store), store.all()) == [1.0, 1.0, 1.0]

"""kv-cache-utilization-scorer (kvgate.epp.scheduling.plugins.kv_cache_utilization_scorer)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.kv_cache_utilization_scorer import KVCacheUtilizationScorer
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_kv_cache_scorer(store: Datastore) -> None:
    a = store.all()[0].address
    set_metrics(store, a, kv_usage=0.75)
    assert KVCacheUtilizationScorer().score(ctx_for(store), store.all()) == [0.25, 1.0, 1.0]

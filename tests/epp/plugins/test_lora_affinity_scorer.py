"""lora-affinity-scorer (kvgate.epp.scheduling.plugins.lora_affinity_scorer)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_lora_affinity_scorer(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, max_lora=2, running_loras=frozenset({"m"}))
    set_metrics(store, b, max_lora=2, running_loras=frozenset({"x"}))
    set_metrics(store, c, max_lora=1, running_loras=frozenset({"x"}))
    assert LoraAffinityScorer().score(ctx_for(store), store.all()) == [1.0, 0.5, 0.0]

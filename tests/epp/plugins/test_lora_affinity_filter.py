"""lora-affinity-filter (kvgate.epp.scheduling.plugins.lora_affinity_filter)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.lora_affinity_filter import LoraAffinityFilter
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_lora_affinity_filter(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, max_lora=1, running_loras=frozenset({"other"}))
    set_metrics(store, b, max_lora=2, running_loras=frozenset({"other"}))
    set_metrics(store, c, max_lora=2, waiting_loras=frozenset({"m"}))
    f = LoraAffinityFilter()
    assert [e.address for e in f.filter(ctx_for(store), store.all())] == [c]
    assert [e.address for e in f.filter(ctx_for(store), store.all()[:2])] == [b]

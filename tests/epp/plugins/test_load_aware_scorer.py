"""load-aware-scorer (kvgate.epp.scheduling.plugins.load_aware_scorer)."""

from __future__ import annotations

import time

from kvgate.epp.datastore import Datastore, EndpointMetrics
from kvgate.epp.scheduling.plugins.load_aware_scorer import LoadAwareScorer
from kvgate.testing.scheduling import ctx_for, set_metrics


def test_load_aware_scorer_uses_larger_of_scrape_and_inflight_with_response_phase(store: Datastore) -> None:
    a, b, c = store.all()
    set_metrics(store, a.address, running=4, waiting=4)
    b.inflight = 4
    c.inflight = 40
    store.inflight_tracked = True
    assert LoadAwareScorer(threshold=16).score(ctx_for(store), store.all()) == [0.5, 0.75, 0.0]


def test_load_without_response_phase_is_scrape_plus_unconfirmed_picks(store: Datastore) -> None:
    a, b, c = store.all()
    set_metrics(store, a.address, running=4, waiting=4)
    c.inflight = 40  # never decremented without the response phase: must not count
    t0 = time.monotonic()
    for i in range(4):
        b.note_pick(t0 + i * 0.001)
    scorer = LoadAwareScorer(threshold=16)
    assert scorer.score(ctx_for(store), store.all()) == [0.5, 0.75, 1.0]
    assert [e.queue() for e in store.all()] == [4, 4, 0]
    # a scrape sent before the picks settled shows none of them yet: all still count
    store.update_metrics(b.address, EndpointMetrics(running=1, updated_at=t0 + 0.01, sent_at=t0 + 0.002))
    assert b.load() == 5
    # a scrape sent well after them shows them in the engine's own counts: ours are dropped
    store.update_metrics(b.address, EndpointMetrics(running=4, updated_at=t0 + 0.2, sent_at=t0 + 0.1))
    assert b.load() == 4 and b.pending == 0

"""prefix-cache-scorer (kvgate.epp.scheduling.plugins.prefix_cache_scorer)."""

from __future__ import annotations

import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from kvgate.testing.scheduling import ctx_for, make_request


def test_approximate_prefix_scorer_learns_from_routing(store: Datastore) -> None:
    scorer = PrefixCacheScorer(block_size=4)
    _a, b, _ = store.all()
    first = ctx_for(store, make_request("abcdefghijkl"))
    assert scorer.score(first, store.all()) == [0.0, 0.0, 0.0]
    scorer.pre_request(first, b)
    again = ctx_for(store, make_request("abcdefgh-other"))
    assert scorer.score(again, store.all()) == pytest.approx([0.0, 2 / 3, 0.0])

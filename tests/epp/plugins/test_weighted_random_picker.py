"""weighted-random-picker (kvgate.epp.scheduling.plugins.weighted_random_picker)."""

from __future__ import annotations

import random
from collections import Counter

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.weighted_random_picker import WeightedRandomPicker
from kvgate.testing.scheduling import ctx_for


def test_weighted_random_picker_follows_weights(store: Datastore) -> None:
    picker = WeightedRandomPicker(rng=random.Random(3))
    eps = store.all()
    wins = Counter(picker.pick(ctx_for(store), eps, [3.0, 1.0, 0.0])[0].address for _ in range(2000))
    assert wins[eps[2].address] == 0
    assert 2.3 < wins[eps[0].address] / wins[eps[1].address] < 3.9
    assert len({picker.pick(ctx_for(store), eps, [0, 0, 0])[0].address for _ in range(100)}) == 3

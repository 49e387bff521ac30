"""random-picker (kvgate.epp.scheduling.plugins.random_picker)."""

from __future__ import annotations

import random

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.random_picker import RandomPicker
from kvgate.testing.scheduling import ctx_for


def test_random_picker_uses_every_endpoint(store: Datastore) -> None:
    picker = RandomPicker(rng=random.Random(2))
    seen = {picker.pick(ctx_for(store), store.all(), [0, 0, 0])[0].address for _ in range(100)}
    assert len(seen) == 3

"""round-robin-picker (kvgate.epp.scheduling.plugins.round_robin_picker)."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.round_robin_picker import RoundRobinPicker
from kvgate.testing.scheduling import ctx_for


def test_round_robin_picker_cycles(store: Datastore) -> None:
    picker = RoundRobinPicker()
    order = [picker.pick(ctx_for(store), store.all(), [0, 0, 0])[0].address for _ in range(6)]
    assert order[:3] == sorted(order[:3]) and order[:3] == order[3:]

"""Flow control's recent work per band (kvgate.epp.recent_work)."""

from __future__ import annotations

import pytest

from kvgate.epp.recent_work import ACTIVE_HALF_LIVES, RecentWork


class Weights:
    def __init__(self, **weights: float) -> None:
        self.weights = weights

    def weight(self, name: str) -> float:
        return self.weights.get(name, 1.0)


def test_a_crowd_of_past_tenants_does_not_thin_the_active_ones_share() -> None:
    """Two hundred tenants that each sent once long ago are not peers of the two sending now:
    A with a third of the recent work is under its half (the walk over every flow ever seen made
    it 65x over a share of 1/202, and held it while the pool was saturated)."""
    work = RecentWork(10.0, Weights())
    for i in range(200):
        work.add(0, f"past{i}", 500.0, now=0.0)
    now = 10.0 * ACTIVE_HALF_LIVES + 1
    work.add(0, "A", 1000.0, now)
    work.add(0, "B", 2000.0, now)
    assert work.ratio(0, "A", (), now) == pytest.approx(1000 / 1500)
    assert work.ratio(0, "B", (), now) == pytest.approx(2000 / 1500)
    assert len(work) == 2  # the past ones forgotten, their work with them


def test_shares_follow_weights_queued_flows_and_lower_bands() -> None:
    work = RecentWork(10.0, Weights(gold=3.0))
    work.add(0, "gold", 3000.0, now=0.0)
    work.add(0, "plain", 1000.0, now=0.0)
    assert work.ratio(0, "gold", (), 0.0) == pytest.approx(1.0)  # 3/4 of 4,000
    assert work.ratio(0, "plain", (), 0.0) == pytest.approx(1.0)
    # a backlogged flow that sent nothing yet is a peer too
    assert work.ratio(0, "plain", ["newcomer"], 0.0) == pytest.approx(1000 / (4000 / 5))
    # a higher band counts the lower bands' work as others': alone in band 1 it is under
    work.add(1, "urgent", 1000.0, now=0.0)
    assert work.ratio(1, "urgent", (), 0.0) == pytest.approx(1000 / 5000)
    # and the lower band does not count the higher one's
    assert work.ratio(0, "plain", (), 0.0) == pytest.approx(1.0)
    assert work.ratio(0, "nobody", (), 0.0) == 0.0
    assert RecentWork(10.0, Weights()).ratio(0, "x", (), 0.0) is None  # nothing sent


def test_work_halves_every_half_life_and_tracking_is_bounded() -> None:
    work = RecentWork(10.0, Weights(), max_flows=10)
    work.add(0, "a", 1000.0, now=0.0)
    work.add(0, "b", 1000.0, now=10.0)  # a's 1000 is 500 by now
    assert work.ratio(0, "a", (), 10.0) == pytest.approx(500 / 750)
    for i in range(50):
        work.add(0, f"t{i}", 1.0, now=11.0)
    assert len(work) == 10

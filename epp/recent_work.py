"""The work each flow dispatched lately, and its share of its band's: flow control's fair-share
rule (kvgate.epp.flow_control) asks it once per request it looks at while the pool is saturated.

Work is decayed (it halves every half-life) and summed per priority band as it is added, so a
flow's ratio costs a look at a few band totals, not a walk over every tenant ever seen. A band's
peers, whose weights divide its work, are the flows that dispatched within `ACTIVE_HALF_LIVES`
half-lives (their work is down to a sixteenth by then) and the ones queued now: a tenant that
sent one request an hour ago no longer thins everyone's share (with the walk it did, until its
work underflowed to zero hours later, so a crowd of past tenants left every active flow "over
its share" and held while saturated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

ACTIVE_HALF_LIVES = 4.0
MAX_FLOWS = 10_000  # tracked at most; past it a band forgets its oldest first


class Weights(Protocol):
    def weight(self, name: str) -> float: ...


class Decaying:
    """A sum that halves every ``half_life`` seconds."""

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        if self._value and now > self._at:
            self._value *= 0.5 ** ((now - self._at) / self.half_life)
            self._at = now
        return self._value

    def add(self, amount: float, now: float) -> None:
        self._value = max(0.0, self.value(now) + amount)
        self._at = max(self._at, now)


@dataclass
class _Flow:
    work: Decaying
    last: float  # when it last dispatched
    weight: float  # as counted in its band's weight sum


@dataclass
class _Band:
    total: Decaying
    flows: OrderedDict[str, _Flow] = field(default_factory=OrderedDict)  # least recently dispatched first
    weight_sum: float = 0.0


class RecentWork:
    def __init__(self, half_life: float, weights: Weights, max_flows: int = MAX_FLOWS) -> None:
        self.half_life = half_life
        self.weights = weights
        self.max_flows = max_flows
        self._bands: dict[int, _Band] = {}
        self._tracked = 0

    def __len__(self) -> int:
        return self._tracked

    def add(self, priority: int, fairness_id: str, amount: float, now: float) -> None:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(Decaying(self.half_life))
        self._expire(band, now)
        flow = band.flows.get(fairness_id)
        if flow is None:
            if self._tracked >= self.max_flows and band.flows:
                self._forget(band, next(iter(band.flows)), now)
            flow = band.flows[fairness_id] = _Flow(Decaying(self.half_life), now, 0.0)
            self._tracked += 1
        band.flows.move_to_end(fairness_id)
        flow.last = now
        weight = self.weights.weight(fairness_id)  # (a reloaded tenants file may change it)
        band.weight_sum += weight - flow.weight
        flow.weight = weight
        flow.work.add(amount, now)
        band.total.add(amount, now)

    def ratio(self, priority: int, fairness_id: str, queued: Iterable[str], now: float) -> float | None:
        """This flow's recent work over its weighted share of the recent work of its band and the
        bands below it (an engine runs lower priorities after it, so their work counts as others'
        while it is not this flow's); its share divides by the weights of the band's active flows
        and of `queued` (the band's backlogged fairness ids). None while nothing was sent."""
        total = 0.0
        for p, below in self._bands.items():
            if p <= priority:
                self._expire(below, now)
                total += below.total.value(now)
        band = self._bands.get(priority)
        own = band.flows.get(fairness_id) if band is not None else None
        mine = own.work.value(now) if own is not None else 0.0
        weights = band.weight_sum if band is not None else 0.0
        if own is None:
            weights += self.weights.weight(fairness_id)
        for tenant in queued:
            if tenant != fairness_id and (band is None or tenant not in band.flows):
                weights += self.weights.weight(tenant)
        if not weights or total <= 0:
            return None
        fair = self.weights.weight(fairness_id) / weights * total
        return mine / fair if fair > 0 else None

    def _expire(self, band: _Band, now: float) -> None:
        horizon = now - ACTIVE_HALF_LIVES * self.half_life
        while band.flows:
            oldest, flow = next(iter(band.flows.items()))
            if flow.last >= horizon:
                break
            self._forget(band, oldest, now)

    def _forget(self, band: _Band, fairness_id: str, now: float) -> None:
        flow = band.flows.pop(fairness_id)
        self._tracked -= 1
        band.weight_sum -= flow.weight
        band.total.add(-flow.work.value(now), now)  # what is left of it counts for no one now
        if not band.flows:
            band.weight_sum = 0.0  # (no float drift left behind)
            band.total = Decaying(self.half_life)

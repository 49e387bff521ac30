"""Pickers: weighted scores in, the chosen endpoint (then fallbacks) out."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext


@dataclass
class MaxScorePicker:
    """Highest score wins; ties broken at random so equal endpoints share load."""

    type_name: ClassVar[str] = "max-score-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        if not endpoints:
            return []
        # A random secondary key breaks ties without favouring list order.
        rand = self.rng.random
        order = sorted(range(len(endpoints)), key=lambda i: (-scores[i], rand()))
        return [endpoints[i] for i in order[: self.max_num_of_endpoints]]


@dataclass
class RandomPicker:
    type_name: ClassVar[str] = "random-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        return self.rng.sample(endpoints, min(self.max_num_of_endpoints, len(endpoints)))


@dataclass
class WeightedRandomPicker:
    """Chooses with probability proportional to score (uniform when every score is 0)."""

    type_name: ClassVar[str] = "weighted-random-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        remaining = list(range(len(endpoints)))
        chosen: list[EndpointState] = []
        while remaining and len(chosen) < self.max_num_of_endpoints:
            weights = [scores[i] for i in remaining]
            if sum(weights) <= 0:
                i = self.rng.choice(remaining)
            else:
                i = self.rng.choices(remaining, weights=weights)[0]
            remaining.remove(i)
            chosen.append(endpoints[i])
        return chosen


@dataclass
class RoundRobinPicker:
    """Cycles through the candidates in address order, ignoring scores (a baseline)."""

    type_name: ClassVar[str] = "round-robin-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    _next: int = 0

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        if not endpoints:
            return []
        ordered = sorted(endpoints, key=lambda e: e.address)
        start = self._next % len(ordered)
        self._next += 1
        rotated = ordered[start:] + ordered[:start]
        return rotated[: self.max_num_of_endpoints]

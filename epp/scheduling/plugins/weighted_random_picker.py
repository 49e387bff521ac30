"""The `weighted-random-picker` picker (WeightedRandomPicker)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class WeightedRandomPicker:
    """Chooses with probability proportional to score (uniform when every score is 0)."""

    type_name: ClassVar[str] = "weighted-random-picker"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
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

"""The `random-picker` picker (RandomPicker)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class RandomPicker:
    type_name: ClassVar[str] = "random-picker"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        return self.rng.sample(endpoints, min(self.max_num_of_endpoints, len(endpoints)))

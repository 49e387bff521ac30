"""The `round-robin-picker` picker (RoundRobinPicker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class RoundRobinPicker:
    """Cycles through the candidates in address order, ignoring scores (a baseline)."""

    type_name: ClassVar[str] = "round-robin-picker"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
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

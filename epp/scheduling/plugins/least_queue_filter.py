"""The `least-queue-filter` filter (LeastQueueFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins._band import lowest_band
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LeastQueueFilter:
    """Keeps the endpoints in the lowest band of waiting queue length.

    The band is (max - min) / len(endpoints) wide, as in GIE's least-queue filter, so a handful
    of nearly-equal endpoints all survive while clear outliers are dropped.
    """

    type_name: ClassVar[str] = "least-queue-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADMISSIONS})
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return lowest_band(endpoints, [e.queue() for e in endpoints])

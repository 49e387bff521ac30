"""The `fresh-metrics-filter` filter (FreshMetricsFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class FreshMetricsFilter:
    """Drops endpoints whose metrics are older than ``stalenessSeconds`` (or never scraped)."""

    type_name: ClassVar[str] = "fresh-metrics-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS})
    name: str = type_name
    staleness_seconds: float = 2.0

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        limit = self.staleness_seconds
        return [e for e in endpoints if e.age(ctx.now) <= limit]

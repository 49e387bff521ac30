"""The `least-kv-cache-filter` filter (LeastKVCacheFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins._band import lowest_band
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LeastKVCacheFilter:
    """Keeps the endpoints in the lowest band of KV-cache use (GIE's least-kv-cache filter)."""

    type_name: ClassVar[str] = "least-kv-cache-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS})
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return lowest_band(endpoints, [e.metrics.kv_usage for e in endpoints])

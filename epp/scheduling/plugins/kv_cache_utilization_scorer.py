"""The `kv-cache-utilization-scorer` scorer (KVCacheUtilizationScorer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class KVCacheUtilizationScorer:
    """More free KV cache scores higher: 1 - utilisation."""

    type_name: ClassVar[str] = "kv-cache-utilization-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS})
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        return [1.0 - e.metrics.kv_usage for e in endpoints]

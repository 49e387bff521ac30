"""Is the pool too busy to take sheddable (negative-priority) work?"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.api.contracts.metrics import SATURATION_KV_CACHE_UTILIZATION, SATURATION_QUEUE_DEPTH, saturation
from kvgate.epp.datastore import EndpointState

METRICS_STALENESS_S = 2.0  # older metrics count as saturated


@dataclass
class SaturationDetector:
    queue_depth_threshold: float = SATURATION_QUEUE_DEPTH
    kv_cache_util_threshold: float = SATURATION_KV_CACHE_UTILIZATION
    metrics_staleness_threshold: float = METRICS_STALENESS_S  # seconds

    def endpoint_saturation(self, state: EndpointState, now: float) -> float:
        """≥ 1.0 means saturated: max(waiting / queue threshold, kv use / kv threshold)."""
        if state.age(now) > self.metrics_staleness_threshold:
            return 1.0
        return saturation(
            state.waiting_after_picks(),
            state.metrics.kv_usage,
            self.queue_depth_threshold,
            self.kv_cache_util_threshold,
        )

    def pool_saturation(self, endpoints: list[EndpointState], now: float) -> float:
        if not endpoints:
            return 1.0
        return sum(self.endpoint_saturation(e, now) for e in endpoints) / len(endpoints)

    def saturated(self, endpoints: list[EndpointState], now: float) -> bool:
        return self.pool_saturation(endpoints, now) >= 1.0

"""Is the pool too busy to take sheddable (negative-priority) work?"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.epp.datastore import EndpointState


@dataclass
class SaturationDetector:
    queue_depth_threshold: float = 5.0
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: float = 2.0  # seconds; older metrics count as saturated

    def endpoint_saturation(self, state: EndpointState, now: float) -> float:
        """≥ 1.0 means saturated: max(waiting / queue threshold, kv use / kv threshold)."""
        if state.age(now) > self.metrics_staleness_threshold:
            return 1.0
        m = state.metrics
        return max(state.queue() / self.queue_depth_threshold, m.kv_usage / self.kv_cache_util_threshold)

    def pool_saturation(self, endpoints: list[EndpointState], now: float) -> float:
        if not endpoints:
            return 1.0
        return sum(self.endpoint_saturation(e, now) for e in endpoints) / len(endpoints)

    def saturated(self, endpoints: list[EndpointState], now: float) -> bool:
        return self.pool_saturation(endpoints, now) >= 1.0

"""The `load-aware-scorer` scorer (LoadAwareScorer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LoadAwareScorer:
    """Absolute load: 1 when idle, falling linearly to 0 at ``threshold`` requests in flight.

    Unlike the min-max queue scorer, equal-but-high load does not score 1, and a gap of N
    requests costs the same whatever the others carry, which is what lets a prefix holder
    lose once it is clearly busier than its peers. Load is the scraped running+waiting count
    plus this EPP's picks no scrape shows yet (and, when Envoy sends the response phase, at
    least the requests this EPP has in flight there).
    """

    type_name: ClassVar[str] = "load-aware-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADMISSIONS})
    name: str = type_name
    threshold: float = 16.0

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        t = self.threshold
        tracked = ctx.datastore.inflight_tracked
        return [max(0.0, 1.0 - e.load(tracked) / t) for e in endpoints]

"""The `queue-scorer` scorer (QueueScorer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class QueueScorer:
    """Shorter waiting queue scores higher, min-max normalised over the candidates (GIE).

    The queue includes this EPP's picks the last scrape cannot show yet, so a burst between
    two scrapes spreads out instead of piling onto the endpoint that looked emptiest."""

    type_name: ClassVar[str] = "queue-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADMISSIONS})
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        queues = [e.queue() for e in endpoints]
        lo, hi = min(queues), max(queues)
        if hi == lo:
            return [1.0] * len(endpoints)
        span = hi - lo
        return [(hi - q) / span for q in queues]

"""The `bounded-load-filter` filter (BoundedLoadFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class BoundedLoadFilter:
    """Drops endpoints far busier than the least busy one, as consistent hashing with bounded
    loads does: a load (running + waiting + picks not yet scraped) above both
    ``absoluteSlack`` more than the least loaded endpoint's and ``relativeSlack`` times it.

    Affinity (a prefix, a conversation) then holds only while its holder stays within reach of
    its peers; one hot prefix cannot pile every request onto one engine, whose KV then thrashes
    while the others idle. Tight enough to stop that, loose enough to leave a warm holder its
    ordinary queue."""

    type_name: ClassVar[str] = "bounded-load-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADMISSIONS})
    name: str = type_name
    absolute_slack: int = 16
    relative_slack: float = 2.0

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        if not endpoints:
            return endpoints
        loads = [e.load() for e in endpoints]
        least = min(loads)
        bound = max(least + self.absolute_slack, least * self.relative_slack)
        return [e for e, load in zip(endpoints, loads, strict=True) if load <= bound]

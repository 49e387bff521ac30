"""The `low-queue-filter` filter (LowQueueFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LowQueueFilter:
    """Keeps endpoints whose waiting queue is at most ``threshold`` (GIE's low-queue filter)."""

    type_name: ClassVar[str] = "low-queue-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADMISSIONS})
    name: str = type_name
    threshold: int = 128

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return [e for e in endpoints if e.queue() <= self.threshold]

"""The `lora-affinity-scorer` scorer (LoraAffinityScorer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.adapters import request_adapter
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LoraAffinityScorer:
    """GIE's LoRA affinity: for a request naming an adapter, 1 where the adapter is running or
    waiting (no load), 0.5 where a slot is free (a load, nothing evicted), 0 where the engine is
    at max_lora without it (a load that waits for a slot) or serves no LoRA at all. Base-model
    requests score 1 everywhere: they need no adapter slot."""

    type_name: ClassVar[str] = "lora-affinity-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADAPTERS})
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        adapter = request_adapter(ctx)
        if adapter is None:
            return [1.0] * len(endpoints)
        out: list[float] = []
        for e in endpoints:
            m = e.metrics
            if m.has_adapter(adapter):
                out.append(1.0)
            elif len(m.running_loras) < m.max_lora:
                out.append(0.5)
            else:
                out.append(0.0)
        return out

"""The `lora-affinity-filter` filter (LoraAffinityFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.adapters import request_adapter
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class LoraAffinityFilter:
    """For a request naming an adapter: the endpoints that run (or queue) it, else those with a
    free adapter slot, else all. Base-model requests pass through.

    ``loaded_only`` false (kvgate's profile): the endpoints that run it *and* those with a free
    slot, so scorers may still spread a hot adapter; only engines where it would wait for a slot
    (every slot busy with other adapters' running requests) are dropped, unless nothing else is
    left."""

    type_name: ClassVar[str] = "lora-affinity-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.METRICS, Consumes.ADAPTERS})
    name: str = type_name
    loaded_only: bool = True

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        adapter = request_adapter(ctx)
        if adapter is None:
            return endpoints
        loaded = [e for e in endpoints if e.metrics.has_adapter(adapter)]
        free = [e for e in endpoints if e not in loaded and len(e.metrics.running_loras) < e.metrics.max_lora]
        if self.loaded_only:
            return loaded or free or endpoints
        return loaded + free or endpoints

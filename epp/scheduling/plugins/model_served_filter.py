"""The `model-served-filter` filter (ModelServedFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class ModelServedFilter:
    """Keeps the endpoints that serve the request's target model (base model or adapter), as
    their GET /v1/models lists it (polled every ``MODELS_REFRESH_S``, and within a scrape of a
    runtime adapter load/unload: epp/scraper.py) or, where no list has it yet, as
    vllm:lora_requests_info shows it running there (every scrape).

    Correctness, not preference: an adapter loaded at run time on some engines only must not
    be sent to one that answers 404. An endpoint that has not reported its model list yet is
    kept (unknown is not absent). When no endpoint is known to serve the model, everything
    passes, so the engine's own 404 answers a model served nowhere (or one loaded too recently
    for the scraper to have seen). When every engine serves every model it changes nothing."""

    type_name: ClassVar[str] = "model-served-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset({Consumes.ADAPTERS})
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        model = ctx.request.target_model
        if not model:
            return endpoints
        # A model list beats lora_requests_info: an adapter unloaded while requests still run
        # under it shows running there, yet that engine answers 404 to every new one.
        serving = [e for e in endpoints if model in e.served_models] or [
            e for e in endpoints if e.metrics.has_adapter(model)
        ]
        if not serving:
            return endpoints
        if len(serving) == len(endpoints):
            return endpoints  # the common case: the same list back, nothing rebuilt
        keep = {e.address for e in serving}
        return [e for e in endpoints if not e.served_models or e.address in keep]

"""Filters: endpoints in, the eligible subset out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.adapters import request_adapter
from kvgate.epp.scheduling.framework import SchedulingContext


@dataclass
class FreshMetricsFilter:
    """Drops endpoints whose metrics are older than ``stalenessSeconds`` (or never scraped)."""

    type_name: ClassVar[str] = "fresh-metrics-filter"
    name: str = type_name
    staleness_seconds: float = 2.0

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        limit = self.staleness_seconds
        return [e for e in endpoints if e.age(ctx.now) <= limit]


@dataclass
class LowQueueFilter:
    """Keeps endpoints whose waiting queue is at most ``threshold`` (GIE's low-queue filter)."""

    type_name: ClassVar[str] = "low-queue-filter"
    name: str = type_name
    threshold: int = 128

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return [e for e in endpoints if e.queue() <= self.threshold]


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


@dataclass
class LeastQueueFilter:
    """Keeps the endpoints in the lowest band of waiting queue length.

    The band is (max - min) / len(endpoints) wide, as in GIE's least-queue filter, so a handful
    of nearly-equal endpoints all survive while clear outliers are dropped.
    """

    type_name: ClassVar[str] = "least-queue-filter"
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return _lowest_band(endpoints, [e.queue() for e in endpoints])


@dataclass
class LeastKVCacheFilter:
    """Keeps the endpoints in the lowest band of KV-cache use (GIE's least-kv-cache filter)."""

    type_name: ClassVar[str] = "least-kv-cache-filter"
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        return _lowest_band(endpoints, [e.metrics.kv_usage for e in endpoints])


@dataclass
class LoraAffinityFilter:
    """For a request naming an adapter: the endpoints that run (or queue) it, else those with a
    free adapter slot, else all. Base-model requests pass through.

    ``loaded_only`` false (kvgate's profile): the endpoints that run it *and* those with a free
    slot, so scorers may still spread a hot adapter; only engines where it would wait for a slot
    (every slot busy with other adapters' running requests) are dropped, unless nothing else is
    left."""

    type_name: ClassVar[str] = "lora-affinity-filter"
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


# GIE's conformance suite names the pods a request may go to in this header
TEST_ENDPOINT_SELECTION_HEADER = "test-epp-endpoint-selection"


@dataclass
class HeaderBasedTestingFilter:
    """Keeps the endpoints a request's ``test-epp-endpoint-selection`` header names (comma
    separated, ``ip`` or ``ip:port``), as GIE's conformance EPP does; with no header, or none
    of its entries in the pool, every endpoint passes. For conformance runs only: it lets a
    client choose its endpoint, so no built-in profile but ``conformance`` has it."""

    type_name: ClassVar[str] = "header-based-testing-filter"
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        wanted = {
            w.strip()
            for w in ctx.request.headers.get(TEST_ENDPOINT_SELECTION_HEADER, "").split(",")
            if w.strip()
        }
        if not wanted:
            return endpoints
        chosen = [e for e in endpoints if e.address in wanted or e.address.rsplit(":", 1)[0] in wanted]
        return chosen or endpoints


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


def _lowest_band(endpoints: list[EndpointState], values: list[float]) -> list[EndpointState]:
    """The endpoints whose value lies within (max - min) / n of the minimum (GIE's band)."""
    if not endpoints:
        return endpoints
    lo, hi = min(values), max(values)
    band = (hi - lo) / len(endpoints)
    return [e for e, v in zip(endpoints, values, strict=True) if v <= lo + band]

"""Which LoRA adapter a request asks for: its target model, when that names an adapter."""

from __future__ import annotations

from kvgate.api.lora import lora_int_id
from kvgate.epp.scheduling.framework import SchedulingContext

_CACHE_KEY = "lora-adapter"


def request_adapter(ctx: SchedulingContext) -> str | None:
    """The adapter name, or None for the base model. A name is an adapter when an engine lists
    it with a parent in GET /v1/models, or reports it running or waiting in
    vllm:lora_requests_info, or when the engines list their models and it is not among the
    base models (an adapter not loaded anywhere yet). Computed once per request."""
    if _CACHE_KEY in ctx.cache:
        found: str | None = ctx.cache[_CACHE_KEY]
        return found
    model = ctx.request.target_model
    store = ctx.datastore
    adapter: str | None = None
    if model:
        if model in store.known_adapters():
            adapter = model
        else:
            states = store.all()
            if any(s.metrics.has_adapter(model) for s in states):
                adapter = model
            else:
                bases = frozenset().union(*(s.served_models - s.served_adapters for s in states))
                if bases and model not in bases:
                    adapter = model
    ctx.cache[_CACHE_KEY] = adapter
    return adapter


def request_lora_id(ctx: SchedulingContext) -> int | None:
    """The id the engine keys this request's KV blocks with (None: base model)."""
    adapter = request_adapter(ctx)
    return None if adapter is None else lora_int_id(adapter)


__all__ = ["request_adapter", "request_lora_id"]

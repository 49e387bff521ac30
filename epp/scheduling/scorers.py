"""Scorers: one score in [0, 1] per endpoint; the profile multiplies by a weight and sums."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.prefix_index import ApproximateIndex, PreciseIndex, RecentPicks, block_keys, root_key
from kvgate.epp.scheduling.adapters import request_adapter, request_lora_id
from kvgate.epp.scheduling.framework import (
    AdmissionObserver,
    EndpointForgetter,
    SchedulingContext,
    UsesTokens,
)


@dataclass
class QueueScorer:
    """Shorter waiting queue scores higher, min-max normalised over the candidates (GIE).

    The queue includes this EPP's picks the last scrape cannot show yet, so a burst between
    two scrapes spreads out instead of piling onto the endpoint that looked emptiest."""

    type_name: ClassVar[str] = "queue-scorer"
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        queues = [e.queue() for e in endpoints]
        lo, hi = min(queues), max(queues)
        if hi == lo:
            return [1.0] * len(endpoints)
        span = hi - lo
        return [(hi - q) / span for q in queues]


@dataclass
class KVCacheUtilizationScorer:
    """More free KV cache scores higher: 1 - utilisation."""

    type_name: ClassVar[str] = "kv-cache-utilization-scorer"
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        return [1.0 - e.metrics.kv_usage for e in endpoints]


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
    name: str = type_name
    threshold: float = 16.0

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        t = self.threshold
        tracked = ctx.datastore.inflight_tracked
        return [max(0.0, 1.0 - e.load(tracked) / t) for e in endpoints]


@dataclass
class LoraAffinityScorer:
    """GIE's LoRA affinity: for a request naming an adapter, 1 where the adapter is running or
    waiting (no load), 0.5 where a slot is free (a load, nothing evicted), 0 where the engine is
    at max_lora without it (a load that waits for a slot) or serves no LoRA at all. Base-model
    requests score 1 everywhere: they need no adapter slot."""

    type_name: ClassVar[str] = "lora-affinity-scorer"
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


@dataclass
class PrefixCacheScorer:
    """GIE's approximate prefix scorer: prompt text hashed in character blocks, remembered per
    endpoint when this EPP routes there. Needs no tokenizer and no engine cooperation."""

    type_name: ClassVar[str] = "prefix-cache-scorer"
    name: str = type_name
    block_size: int = 64  # characters
    max_prefix_blocks: int = 256
    lru_capacity: int = 200_000
    index: ApproximateIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = ApproximateIndex(self.lru_capacity)

    def _keys(self, ctx: SchedulingContext) -> list[int]:
        cache_key = f"{self.name}:keys"
        keys = ctx.cache.get(cache_key)
        if keys is None:
            text = ctx.request.prompt_text
            parent = hash((root_key(None), ctx.request.target_model))
            keys = []
            size = self.block_size
            for start in range(0, min(len(text), size * self.max_prefix_blocks) - size + 1, size):
                parent = hash((parent, text[start : start + size]))
                keys.append(parent)
            ctx.cache[cache_key] = keys
        return keys

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        keys = self._keys(ctx)
        if not keys:
            return [0.0] * len(endpoints)
        hits = self.index.prefix_blocks(keys, [e.address for e in endpoints])
        n = len(keys)
        return [hits[e.address] / n for e in endpoints]

    def pre_request(self, ctx: SchedulingContext, target: EndpointState) -> None:
        self.index.record(self._keys(ctx), target.address)

    def forget_endpoint(self, address: str) -> None:
        """The endpoint left the pool: a new pod on the same ip:port must not inherit its prefixes."""
        self.index.forget_endpoint(address)


@dataclass
class PrecisePrefixCacheScorer:
    """Fraction of the request's token blocks the endpoint holds, as the longest run from the
    start, read from the KV-event index. Endpoints that publish no events fall back to an
    approximate index of the same token-block keys, fed by our own routing."""

    type_name: ClassVar[str] = "precise-prefix-cache-scorer"
    uses_tokens: ClassVar[bool] = True  # the EPP loads the model's tokenizer for it
    name: str = type_name
    # Tokens per block for endpoints that have published no KV event yet (and for the fallback
    # index). An endpoint's own events say its real block size, and that one is used for it:
    # a fixed size that differs from the engine's would match nothing, without a word.
    block_size: int = 16
    lru_capacity: int = 200_000
    # How long our own routing counts as "cached there" on an endpoint that does publish
    # events: covers the gap before its BlockStored arrives, so a burst of same-prefix
    # requests does not scatter.
    recent_window_seconds: float = 2.0
    # Which tier's blocks count: "gpu", the device's (what the engine computes nothing for);
    # "any", the device's or its host tier's (what it loads instead of computing). llm-d's
    # tiered prefix cache scores both with two of these at fixed weights.
    tier: str = "gpu"
    fallback: ApproximateIndex = field(init=False)
    recent: RecentPicks = field(init=False)

    def __post_init__(self) -> None:
        if self.tier not in ("gpu", "any"):
            raise ValueError(f"tier must be gpu or any, not {self.tier!r}")
        self.fallback = ApproximateIndex(self.lru_capacity)
        self.recent = RecentPicks(self.recent_window_seconds)

    def _keys(self, ctx: SchedulingContext, block_size: int | None = None) -> list[int]:
        size = block_size or self.block_size
        cache_key = f"token-block-keys:{size}"
        keys = ctx.cache.get(cache_key)
        if keys is None:
            req = ctx.request
            keys = block_keys(req.token_ids, size, request_lora_id(ctx)) if req.body else []
            ctx.cache[cache_key] = keys
        return keys

    def block_keys_for(self, ctx: SchedulingContext) -> list[int]:
        """The request's block keys in the default block size."""
        return self._keys(ctx)

    def cached_fractions(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[str, float]:
        """Per endpoint: the fraction of the prompt's full blocks it holds, from the start.
        Computed once per request and shared (the latency scorer reads it too)."""
        cache_key = f"{self.name}:fractions"
        done: dict[str, float] | None = ctx.cache.get(cache_key)
        if done is not None and all(e.address in done for e in endpoints):
            return done
        keys = self._keys(ctx)
        if not keys:
            return dict.fromkeys((e.address for e in endpoints), 0.0)
        index = ctx.datastore.index
        by_size: dict[int, list[str]] = {}
        blind = []
        for e in endpoints:
            if e.kv_events_live:
                by_size.setdefault(index.block_size(e.address) or self.block_size, []).append(e.address)
            else:
                blind.append(e.address)
        fractions: dict[str, float] = {}
        servable: dict[str, float] = {}  # blocks it can serve without computing: either tier
        default_sized: dict[str, int] = {}  # blocks held, for endpoints with the default size
        for size, live in by_size.items():
            sized = self._keys(ctx, size)
            hits = index.prefix_blocks(sized, live) if sized else dict.fromkeys(live, 0)
            fractions.update((a, n / len(sized) if sized else 0.0) for a, n in hits.items())
            if sized:
                reach = index.extend_through_host(sized, hits)
                servable.update((a, n / len(sized)) for a, n in reach.items() if n > hits[a])
            if size == self.block_size:
                default_sized = hits
        if by_size and self.recent_window_seconds > 0:
            # Our own recent picks (recorded in the default block size) bridge the gap before
            # the engine's BlockStored arrives; what the index shows is their floor.
            live = [a for group in by_size.values() for a in group]
            recent = self.recent.prefix_blocks(keys, live, ctx.now, default_sized)
            for address, n in recent.items():
                fractions[address] = max(fractions[address], n / len(keys))
        if blind:
            fractions.update((a, n / len(keys)) for a, n in self.fallback.prefix_blocks(keys, blind).items())
        ctx.cache[cache_key] = fractions
        ctx.cache[f"{self.name}:servable"] = {a: max(f, fractions[a]) for a, f in servable.items()}
        return fractions

    def servable_fractions(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[str, float]:
        """Per endpoint: the fraction of the prompt's full blocks it can serve without computing
        (held on the device or in its host tier, from the start); at least `cached_fractions`."""
        fractions = self.cached_fractions(ctx, endpoints)
        servable: dict[str, float] = ctx.cache.get(f"{self.name}:servable", {})
        return {e.address: servable.get(e.address, fractions[e.address]) for e in endpoints}

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        fractions = (
            self.servable_fractions(ctx, endpoints)
            if self.tier == "any"
            else self.cached_fractions(ctx, endpoints)
        )
        return [fractions[e.address] for e in endpoints]

    def pre_request(self, ctx: SchedulingContext, target: EndpointState, until: float | None = None) -> None:
        """Record the pick; `until`: when the engine is expected to have computed the prompt
        (the recent pick then counts at least that long)."""
        keys = self._keys(ctx)
        if not target.kv_events_live:
            # Only an endpoint without KV events is scored from the fallback; recording every
            # pick's ~450 keys into the LRU anyway was a sixth of a long prompt's pick.
            self.fallback.record(keys, target.address, ctx.now)
        if self.recent_window_seconds > 0:
            self.recent.record(keys, target.address, ctx.now, until)

    def observe_admission(
        self,
        address: str,
        token_ids: list[int],
        now: float,
        index: PreciseIndex,
        lora_id: int | None = None,
        state: EndpointState | None = None,
    ) -> int:
        """Another EPP replica's pick, announced by the engine; returns the tokens the engine
        must compute for it."""
        return self.record_admission(address, token_ids, now, index, lora_id)[1]

    def record_admission(
        self,
        address: str,
        token_ids: list[int],
        now: float,
        index: PreciseIndex,
        lora_id: int | None = None,
        until: Callable[[int], float] | None = None,
    ) -> tuple[list[int], int]:
        """Another EPP replica's pick, announced by the engine: bridge the gap before its
        BlockStored as for our own picks. Returns the prompt's block keys (default size) and
        the tokens the engine must compute for it (what it had cached or was about to).
        `until`: given those tokens, when the engine is expected to have computed them."""
        keys = block_keys(token_ids, self.block_size, lora_id)
        size = index.block_size(address) or self.block_size
        sized = keys if size == self.block_size else block_keys(token_ids, size, lora_id)
        cached = index.prefix_blocks(sized, [address]).get(address, 0) * size if sized else 0
        if self.recent_window_seconds > 0 and keys:
            recent = self.recent.prefix_blocks(keys, [address], now).get(address, 0) * self.block_size
            cached = max(cached, recent)
            uncached = max(0, len(token_ids) - cached)
            self.recent.record(keys, address, now, until(uncached) if until is not None else None)
            return keys, uncached
        return keys, max(0, len(token_ids) - cached)

    def forget_endpoint(self, address: str) -> None:
        self.fallback.forget_endpoint(address)
        self.recent.forget_endpoint(address)


__all__ = [
    "KVCacheUtilizationScorer",
    "LoadAwareScorer",
    "LoraAffinityScorer",
    "PrecisePrefixCacheScorer",
    "PrefixCacheScorer",
    "QueueScorer",
]


if TYPE_CHECKING:  # mypy holds each scorer to the contracts the profile resolves on it
    _contracts: tuple[
        type[EndpointForgetter], type[EndpointForgetter], type[AdmissionObserver], type[UsesTokens]
    ] = (
        PrefixCacheScorer,
        PrecisePrefixCacheScorer,
        PrecisePrefixCacheScorer,
        PrecisePrefixCacheScorer,
    )

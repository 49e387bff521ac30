"""The `precise-prefix-cache-scorer` scorer (PrecisePrefixCacheScorer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.prefix_index import ApproximateIndex, PreciseIndex, RecentPicks, block_keys
from kvgate.epp.scheduling.adapters import request_lora_id
from kvgate.epp.scheduling.framework import AdmissionObserver, EndpointForgetter, SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class PrecisePrefixCacheScorer:
    """Fraction of the request's token blocks the endpoint holds, as the longest run from the
    start, read from the KV-event index. Endpoints that publish no events fall back to an
    approximate index of the same token-block keys, fed by our own routing."""

    type_name: ClassVar[str] = "precise-prefix-cache-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset(
        {Consumes.TOKENS, Consumes.KV_INDEX, Consumes.ADMISSIONS, Consumes.ADAPTERS}
    )
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


if TYPE_CHECKING:  # mypy holds the scorer to the contracts the profile resolves on it
    _contracts: tuple[type[EndpointForgetter], type[AdmissionObserver]] = (
        PrecisePrefixCacheScorer,
        PrecisePrefixCacheScorer,
    )

"""The prefill/decode profile handler: per request, aggregated or disaggregated (llm-d's
pd-profile-handler, on kvgate's signals).

The director first picks the decode engine with the normal profile over the endpoints that may
be a destination (roles decode and both). This handler then asks how many prompt tokens that
engine would still have to compute (the precise prefix index, plus this replica's own recent
picks for the gap before an engine's BlockStored arrives). Only when that is more than the
threshold does a KV hand-off pay: a prefill engine is picked among the prefill and both
endpoints (not the decode engine itself) by a small profile of its own (precise prefix 3,
queue 2, as GIE weighs prefix and queue), and its address travels to the decode engine in
``x-prefiller-host-port``. Otherwise the decode engine serves the request whole.

A short or mostly cached prompt is never split: the hand-off's fixed cost (a second request, a
transfer) is more than computing a few hundred tokens in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.api.contracts.disaggregation import serves_prefill
from kvgate.epp.datastore import EndpointState
from kvgate.epp.prefix_index import PreciseIndex
from kvgate.epp.scheduling.framework import SchedulingContext, SchedulingProfile
from kvgate.epp.scheduling.plugins.max_score_picker import MaxScorePicker
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scheduling.plugins.queue_scorer import QueueScorer
from kvgate.epp.scheduling.registry import Consumes

# Decision labels (the EPP's kvgate_epp_pd_decisions_total{decision, reason}).
DISAGGREGATED = "disaggregated"
AGGREGATED = "aggregated"
ABOVE_THRESHOLD = "above-threshold"
BELOW_THRESHOLD = "below-threshold"
NO_PREFILL_ENDPOINT = "no-prefill-endpoint"


@dataclass(frozen=True)
class Split:
    """What the handler decided for one request."""

    prefill: EndpointState | None  # None: aggregated on the decode engine
    uncached: int  # prompt tokens the decode engine would compute itself
    reason: str  # ABOVE_THRESHOLD (then prefill is set), BELOW_THRESHOLD or NO_PREFILL_ENDPOINT
    prefill_uncached: int = 0  # prompt tokens the prefill engine computes

    @property
    def decision(self) -> str:
        return DISAGGREGATED if self.prefill is not None else AGGREGATED


def _prefill_profile() -> SchedulingProfile:
    return SchedulingProfile(
        "prefill",
        [],
        [
            (PrecisePrefixCacheScorer(name="prefill/precise-prefix-cache-scorer"), 3.0),
            (QueueScorer(name="prefill/queue-scorer"), 2.0),
        ],
        MaxScorePicker(name="prefill/max-score-picker"),
    )


@dataclass
class PrefillDecodeHandler:
    """llm-d's pd-profile-handler. Not a configurable plugin type: the config's ``pdThreshold``
    (or --pd-threshold) turns it on; it declares what it consumes all the same, so the EPP builds
    its data sources."""

    type_name: ClassVar[str] = "pd-profile-handler"
    consumes: ClassVar[frozenset[Consumes]] = frozenset(
        {Consumes.TOKENS, Consumes.KV_INDEX, Consumes.ADMISSIONS, Consumes.METRICS, Consumes.ADAPTERS}
    )
    # Uncached prompt tokens at the decode engine above which the prefill goes elsewhere
    # (0: every prompt with anything to compute is split).
    threshold: int
    decode_prefix: PrecisePrefixCacheScorer = field(
        default_factory=lambda: PrecisePrefixCacheScorer(name="pd/decode-prefix")
    )
    prefill_profile: SchedulingProfile = field(default_factory=_prefill_profile)

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"the P/D threshold must be >= 0 tokens, got {self.threshold}")

    @staticmethod
    def _uncached(ctx: SchedulingContext, scorer: PrecisePrefixCacheScorer, target: EndpointState) -> int:
        n = len(ctx.request.token_ids)
        full = n - n % scorer.block_size
        fraction = scorer.cached_fractions(ctx, [target])[target.address]
        return n - int(fraction * full)

    def decide(self, ctx: SchedulingContext, decode: EndpointState, pool: list[EndpointState]) -> Split:
        """``decode``: the destination the profile chose; ``pool``: every reachable endpoint."""
        uncached = self._uncached(ctx, self.decode_prefix, decode)
        if uncached <= self.threshold:
            return Split(None, uncached, BELOW_THRESHOLD)
        prefillers = [e for e in pool if e is not decode and serves_prefill(e.endpoint.role)]
        if not prefillers:
            return Split(None, uncached, NO_PREFILL_ENDPOINT)
        result = self.prefill_profile.run(ctx, prefillers)
        if not result.targets:
            return Split(None, uncached, NO_PREFILL_ENDPOINT)
        prefill = result.targets[0]
        prefix = self.prefill_profile.scorers[0][0]
        assert isinstance(prefix, PrecisePrefixCacheScorer)
        return Split(prefill, uncached, ABOVE_THRESHOLD, self._uncached(ctx, prefix, prefill))

    def commit(self, ctx: SchedulingContext, decode: EndpointState, split: Split) -> None:
        """The request goes out: the decode engine will hold the prompt's KV either way (computed
        or pulled), the prefill engine computes it and keeps it cached (later prompts sharing the
        prefix find it there), and its queue carries the work until a scrape shows it."""
        self.decode_prefix.pre_request(ctx, decode)
        if split.prefill is not None:
            self.prefill_profile.pre_request(ctx, split.prefill)
            split.prefill.note_pick(ctx.now, split.prefill_uncached)

    def forget_endpoint(self, address: str) -> None:
        """The endpoint left the pool: a new pod on its ip:port inherits nothing."""
        self.decode_prefix.forget_endpoint(address)
        for plugin in self.prefill_profile.forgetters:
            plugin.forget_endpoint(address)

    def observe_admission(
        self, address: str, token_ids: list[int], now: float, index: PreciseIndex, lora_id: int | None
    ) -> None:
        """Another replica's pick, announced by the engine that admitted it: the engine will hold
        that prompt, as our own picks record."""
        for scorer in (self.decode_prefix, self.prefill_profile.scorers[0][0]):
            if isinstance(scorer, PrecisePrefixCacheScorer):
                scorer.record_admission(address, token_ids, now, index, lora_id)

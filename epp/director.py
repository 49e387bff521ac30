"""``pick(request) -> Decision``: the whole routing decision, independent of Envoy's protocol."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.api.contracts.admissions import Admission
from kvgate.api.contracts.disaggregation import serves_decode
from kvgate.epp.datastore import Datastore, Endpoint, EndpointState
from kvgate.epp.prefix_index import block_keys
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.framework import PREFILL_TOKENS, SchedulingContext, SchedulingProfile
from kvgate.epp.scheduling.plugins.pd_profile_handler import PrefillDecodeHandler

log = logging.getLogger("kvgate.epp.director")

# Tokens per KV block of an engine that has not said (its KV events carry its size).
DEFAULT_BLOCK_SIZE = 16


@dataclass
class Decision:
    status: int  # 200 routed; 429 / 503 / 500 answered by the EPP itself
    targets: list[str] = field(default_factory=list)  # "ip:port", chosen first, then fallbacks
    reason: str = ""
    error_type: str = ""
    scheduler_seconds: float = 0.0
    plugin_seconds: dict[str, float] = field(default_factory=dict)
    candidates: int = 0  # endpoints the profile chose among
    # Prefill/decode (only with a P/D handler): the prefill engine's "ip:port" when the request
    # is disaggregated (sent to the decode engine in x-prefiller-host-port), else None;
    # pd_decision "disaggregated" / "aggregated" ("" without a handler) and why.
    prefill: str | None = None
    pd_decision: str = ""
    pd_reason: str = ""
    retry_after: int = 0  # seconds, for a 429/503 the client may retry (Retry-After); 0: none

    @property
    def routed(self) -> bool:
        return self.status == 200


class Director:
    def __init__(
        self,
        datastore: Datastore,
        profile: SchedulingProfile,
        saturation: SaturationDetector,
        clock: Callable[[], float] = time.monotonic,
        pd: PrefillDecodeHandler | None = None,
    ) -> None:
        self.clock = clock  # a virtual one in the routing simulator (kvgate.bench.virtual_pool)
        self.datastore = datastore
        self.profile = profile
        self.saturation = saturation
        # Prefill/decode disaggregation (--pd-threshold); None: every request aggregated.
        self.pd = pd
        datastore.subscribe(self._on_endpoint)
        datastore.subscribe_admissions(self._on_admission)

    def _on_endpoint(self, endpoint: Endpoint, added: bool) -> None:
        # What our own routing remembers about an endpoint dies with it (the KV-event index is
        # cleared by the datastore itself).
        if not added:
            for plugin in self.profile.forgetters:
                plugin.forget_endpoint(endpoint.address)
            if self.pd is not None:
                self.pd.forget_endpoint(endpoint.address)

    def _on_admission(self, address: str, admission: Admission) -> None:
        """Another replica's pick, announced by the engine that admitted it: count it as that
        replica would have (queued prefill work there, recent prefix placement, working set),
        so active-active replicas judge queues and placement alike."""
        state = self.datastore.get(address)
        if state is None:
            return
        now = self.clock()
        tokens = admission.token_ids
        index = self.datastore.index
        uncached: int | None = None
        for observer in self.profile.admission_observers:
            found = observer.observe_admission(address, tokens, now, index, admission.lora_id, state=state)
            if uncached is None:
                uncached = found
        if self.pd is not None:
            self.pd.observe_admission(address, tokens, now, index, admission.lora_id)
        if uncached is None:  # no prefix-aware scorer: what the index says is cached there
            size = index.block_size(address) or DEFAULT_BLOCK_SIZE
            keys = block_keys(tokens, size, admission.lora_id)
            cached = index.prefix_blocks(keys, [address]).get(address, 0) * size if keys else 0
            uncached = max(0, len(tokens) - cached)
        state.note_pick(now, uncached)

    def candidates(self, request: InferenceRequest) -> list[EndpointState]:
        """Reachable endpoints that may be the destination: never a prefill-only one."""
        reachable = self.datastore.reachable
        endpoints = [e for e in self.datastore.all() if reachable(e) and serves_decode(e.endpoint.role)]
        if request.subset is not None:
            allowed = set(request.subset)
            endpoints = [e for e in endpoints if e.address in allowed]
        return endpoints

    def pick(self, request: InferenceRequest, among: list[EndpointState] | None = None) -> Decision:
        """Route one request; `among`: choose only from these candidates (flow control passes
        the ones with room)."""
        t0 = time.perf_counter()
        now = self.clock()
        candidates = self.candidates(request) if among is None else among
        if not candidates:
            if request.subset is not None:
                why = (
                    "no endpoint in the subset hint is eligible" if request.subset else "subset hint is empty"
                )
            elif any(self.datastore.reachable(e) for e in self.datastore.all()):
                why = "no ready decode endpoints in the pool (only prefill endpoints are ready)"
            else:
                why = "no ready endpoints in the pool"
            return Decision(503, reason=why, error_type="service_unavailable")
        if request.priority < 0 and self.saturation.saturated(self.datastore.all(), now):
            return Decision(
                429,
                reason=f"pool saturated; objective {request.objective!r} (priority {request.priority}) is sheddable",
                error_type="rate_limit_exceeded",
            )
        ctx = SchedulingContext(request, self.datastore, now)
        result = self.profile.run(ctx, above_sheddable(candidates) if request.priority >= 0 else candidates)
        if not result.targets:
            return Decision(
                429,
                reason=f"every endpoint was filtered out ({result.filtered_out} of {len(candidates)})",
                error_type="rate_limit_exceeded",
                plugin_seconds=ctx.plugin_seconds,
            )
        chosen = next(e for e in candidates if e.address == result.targets[0].address)
        self.profile.pre_request(ctx, chosen)
        prefill_tokens = ctx.cache.get(PREFILL_TOKENS, {}).get(chosen.address, 0)
        split = None
        if self.pd is not None and request.body is not None:
            pool = [e for e in self.datastore.all() if self.datastore.reachable(e)]
            split = self.pd.decide(ctx, chosen, pool)
            self.pd.commit(ctx, chosen, split)
            if split.prefill is not None:
                prefill_tokens = 0  # computed on the prefill engine; the decode engine pulls the KV
        chosen.note_pick(now, prefill_tokens)
        chosen.inflight += 1
        elapsed = time.perf_counter() - t0
        scores = result.breakdown.get(chosen.address, {})
        reason = f"profile={self.profile.name} score={result.scores[chosen.address]:.3f} " + " ".join(
            f"{k}={v:.2f}" for k, v in scores.items()
        )
        if split is not None:
            assert self.pd is not None
            reason += f" pd={split.decision} ({split.reason}: {split.uncached} uncached tokens, threshold {self.pd.threshold})"
            if split.prefill is not None:
                reason += f" prefill={split.prefill.address}"
        return Decision(
            200,
            targets=[t.address for t in result.targets],
            reason=reason,
            scheduler_seconds=elapsed,
            plugin_seconds=ctx.plugin_seconds,
            candidates=len(candidates),
            prefill=split.prefill.address if split is not None and split.prefill is not None else None,
            pd_decision=split.decision if split is not None else "",
            pd_reason=split.reason if split is not None else "",
        )

    def response_seen(self) -> None:
        """Envoy sends us the response phase: from now on ``inflight`` is exact and counts."""
        self.datastore.inflight_tracked = True

    def finished(self, address: str) -> None:
        """The exchange for a request routed to ``address`` ended (any outcome).

        Without the response phase this runs when Envoy closes the ext_proc stream, which may
        be right after the request phase; ``inflight`` then counts only once the response phase
        has been seen (``response_seen``)."""
        state = self.datastore.get(address)
        if state is not None and state.inflight > 0:
            state.inflight -= 1


def above_sheddable(candidates: list[EndpointState]) -> list[EndpointState]:
    """The candidates as a request of a default or higher priority sees them: kvgate's engines
    preempt sheddable work (a batch line) for it, so their sheddable part of running, waiting and
    prefill pending is left out (views; the datastore's states are not touched). Without that,
    an engine whose slots a batch fills looks full, and online requests crowd onto the engine
    that holds online work, which they cannot preempt."""
    if not any(e.metrics.has_sheddable for e in candidates):
        return candidates
    return [
        dataclasses.replace(e, metrics=e.metrics.without_sheddable()) if e.metrics.has_sheddable else e
        for e in candidates
    ]

"""Routing on a predicted time to first token, llm-d style, with the EPP's own signals.

For each candidate the scorer estimates when this request's first token would come out there:
the prefill work already ahead of it (the engine's own count, `kvgate:prefill_tokens_pending`,
plus this replica's picks no scrape shows yet), the prompt tokens it would have to compute
there (the precise prefix index says what is cached), the blocks it would load back from its
host KV tier instead (a CPU-tier hit is neither free nor a miss: it costs the copy), and that
engine's speed — seconds per prefill token, per engine step and per block copied, learnt online
from its own counters (see LatencyModel).

Greedy TTFT alone scatters under pressure: a request that leaves a busy holder pays a long
prefill on a cold engine, which then looks busy, evicts that engine's prefixes, and the cascade
repeats. So the cost of a pick also charges what it takes from the pool: its own prefill work
again (`work_penalty`: the requests queued behind it there wait for it too), and the blocks it
would push out of an engine whose recent working set (what this replica routed there in the
last `working_set_seconds`) already fills its KV pool (`eviction_penalty`). A prefix then stays
where it lives until waiting there costs more than recomputing it and what the recompute
displaces; a hot prefix spills to a second engine on purpose, which the precise index then
shows as a second holder, instead of scattering. Lowest cost wins.

Per-request SLOs (llm-d's `x-slo-ttft-ms` header, read into the request) only reorder among
endpoints that meet them: any endpoint predicted to meet the SLO beats one that is not.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvgate.epp.datastore import EndpointMetrics, EndpointState
from kvgate.epp.prefix_index import PreciseIndex
from kvgate.epp.scheduling.framework import (
    PREFILL_TOKENS,
    AdmissionObserver,
    EndpointForgetter,
    SchedulingContext,
)
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scheduling.registry import Consumes, register


@dataclass
class EndpointSpeed:
    """One engine's learnt speed."""

    seconds_per_token: float  # prefill work drained per second while busy, inverted
    seconds_per_step: float  # one decode step (the wait for the first token after prefill)
    samples: int = 0  # prefill-speed samples folded in
    step_samples: int = 0
    seconds_per_copied_token: float = 0.0  # host tier <-> device, per token of the blocks copied
    copy_samples: int = 0
    last_copy: tuple[float, float] | None = None  # (seconds, blocks) at the previous scrape
    # the previous scrape's counters, to take differences
    last_at: float = 0.0
    last_computed: float | None = None
    last_busy: bool = False
    last_itl: tuple[float, float] | None = None
    window_tokens: float = 0.0
    window_seconds: float = 0.0
    recent_uncached: deque[int] = field(default_factory=lambda: deque(maxlen=32))

    def mean_uncached(self, default: int) -> float:
        return sum(self.recent_uncached) / len(self.recent_uncached) if self.recent_uncached else default


@dataclass
class LatencyModel:
    """Per-endpoint speed, fitted as the pool runs from counters every vLLM-style engine exports.

    Prefill: between two scrapes that both find the engine busy (prefill work pending, or for an
    engine that does not say, requests waiting), the prompt tokens it computed — the growth of
    `vllm:prompt_tokens_total` less that of `vllm:prefix_cache_hits_total` — over the seconds
    between them is how fast it drains prefill work under its real decode load. Samples pool
    into windows of at least `window_seconds` (a long prefill step can outlast several scrapes)
    and feed an EMA. Decode: the mean inter-token latency over each scrape interval
    (`vllm:inter_token_latency_seconds` sum/count). Until an engine has samples, the pool's mean
    (or the prior) stands in.

    Predictions use the pool's estimate (every engine's samples folded into one EMA) unless
    `per_endpoint` is set: the engines of one pool are alike, and per-engine estimates carry
    enough noise (a window catches one long prefill step or none) that a lucky engine looks
    twice as fast and draws every request, its prefixes nowhere. Heterogeneous pools (mixed
    accelerators) set `per_endpoint`.
    """

    prior_seconds_per_token: float = 1 / 4000
    prior_seconds_per_step: float = 0.025
    # Loading a block back from a host tier, as a fraction of computing it, until the engine's
    # copy counters say: a PCIe-class link moves a block ~50x faster than a GPU computes it.
    prior_copy_fraction: float = 1 / 50
    window_seconds: float = 2.0
    smoothing: float = 0.3
    per_endpoint: bool = False
    speeds: dict[str, EndpointSpeed] = field(default_factory=dict)
    pool: EndpointSpeed | None = None

    def __post_init__(self) -> None:
        self.pool = EndpointSpeed(
            self.prior_seconds_per_token,
            self.prior_seconds_per_step,
            seconds_per_copied_token=self.prior_seconds_per_token * self.prior_copy_fraction,
        )

    def copy_seconds_per_token(self, speed: EndpointSpeed) -> float:
        """What loading one token's KV back from the host tier costs at this endpoint: its own
        measurement once it has one (each engine's host link is its own), else the pool's."""
        assert self.pool is not None
        return speed.seconds_per_copied_token if speed.copy_samples else self.pool.seconds_per_copied_token

    def estimate(self, speed: EndpointSpeed) -> EndpointSpeed:
        """The speed to predict with for an endpoint: its own, or the pool's."""
        assert self.pool is not None
        return speed if self.per_endpoint else self.pool

    def speed(self, address: str) -> EndpointSpeed:
        found = self.speeds.get(address)
        if found is None:
            learnt = [s for s in self.speeds.values() if s.samples]
            per_token = (
                sum(s.seconds_per_token for s in learnt) / len(learnt)
                if learnt
                else self.prior_seconds_per_token
            )
            per_step = (
                sum(s.seconds_per_step for s in learnt) / len(learnt)
                if learnt
                else self.prior_seconds_per_step
            )
            found = self.speeds[address] = EndpointSpeed(per_token, per_step)
        return found

    def _observe_copies(self, speed: EndpointSpeed, m: EndpointMetrics, block_size: int) -> None:
        if m.kv_copy_seconds_total is None or m.kv_blocks_copied_total is None:
            return
        now = (m.kv_copy_seconds_total, m.kv_blocks_copied_total)
        last, speed.last_copy = speed.last_copy, now
        if last is None or now[1] <= last[1] or now[0] < last[0]:
            return
        sample = (now[0] - last[0]) / ((now[1] - last[1]) * block_size)
        for target in (speed, self.pool):
            assert target is not None
            a = self.smoothing if target.copy_samples else 1.0
            target.seconds_per_copied_token += a * (sample - target.seconds_per_copied_token)
            target.copy_samples += 1

    def observe(self, state: EndpointState, block_size: int = 16) -> EndpointSpeed:
        """Fold in the endpoint's latest scrape, once; returns its speed."""
        speed = self.speed(state.address)
        m = state.metrics
        if m.updated_at <= speed.last_at:
            return speed
        self._observe_copies(speed, m, block_size)
        busy = (m.prefill_tokens_pending or 0) > 0 if m.prefill_tokens_pending is not None else m.waiting > 0
        computed = None
        if m.prompt_tokens_total is not None:
            # loaded from a host tier or pulled from a prefill engine: not computed here either
            computed = m.prompt_tokens_total - (m.prefix_hits_total or 0.0) - (m.external_hits_total or 0.0)
        if computed is not None and speed.last_computed is not None and busy and speed.last_busy:
            dt, done = m.updated_at - speed.last_at, computed - speed.last_computed
            if dt > 0 and done >= 0:
                speed.window_seconds += dt
                speed.window_tokens += done
                if speed.window_seconds >= self.window_seconds and speed.window_tokens > 0:
                    sample = speed.window_seconds / speed.window_tokens
                    for target in (speed, self.pool):
                        assert target is not None
                        a = self.smoothing if target.samples else 1.0
                        target.seconds_per_token += a * (sample - target.seconds_per_token)
                        target.samples += 1
                    speed.window_tokens = speed.window_seconds = 0.0
        elif not busy:
            speed.window_tokens = speed.window_seconds = 0.0
        if m.itl_seconds_sum is not None and m.itl_count is not None:
            if speed.last_itl is not None and m.itl_count > speed.last_itl[1]:
                per_step = (m.itl_seconds_sum - speed.last_itl[0]) / (m.itl_count - speed.last_itl[1])
                if per_step > 0:
                    for target in (speed, self.pool):
                        assert target is not None
                        a = self.smoothing if target.step_samples else 1.0
                        target.seconds_per_step += a * (per_step - target.seconds_per_step)
                        target.step_samples += 1
            speed.last_itl = (m.itl_seconds_sum, m.itl_count)
        speed.last_at, speed.last_computed, speed.last_busy = m.updated_at, computed, busy
        return speed

    def forget(self, address: str) -> None:
        self.speeds.pop(address, None)


class WorkingSets:
    """Per endpoint: how many distinct KV blocks (prefix-chain keys) the requests this replica
    sent there within the last `window` seconds hold — what its cache must keep to serve them
    from cache.

    Counted on a sample: only every `sample`-th block of a prompt (positions n-1, 2n-1, ...) is
    kept, and counts are scaled back up. Keys are chained from the prompt's start, so prompts
    that share a prefix share its sampled keys too, and a sampled key stands for itself and
    the n-1 blocks before it: a distinct count at 1/`sample` of the cost that never exceeds
    the true one (a prompt's last < n blocks go uncounted), which keeps the pick cheap on long
    prompts. Kept twice: per endpoint, its keys by when each was last sent there (oldest
    first, so expiry pops from the front and memory follows the working set, not the pick rate
    times the window), and per key the endpoints holding it, so how much of one request every
    endpoint already holds is one pass over the request's sampled keys, not one set
    intersection per endpoint."""

    def __init__(self, window: float, sample: int = 8) -> None:
        self.window = window
        self.sample = sample
        self._where: dict[int, set[str]] = {}
        self._last_seen: dict[str, OrderedDict[int, float]] = {}

    def sampled(self, keys: list[int]) -> frozenset[int]:
        n = self.sample
        return frozenset(keys[n - 1 :: n])

    def touch(self, address: str, sampled: frozenset[int], now: float) -> None:
        where = self._where
        seen = self._last_seen.get(address)
        if seen is None:
            seen = self._last_seen[address] = OrderedDict()
        for key in sampled:
            if key in seen:
                seen.move_to_end(key)
            else:
                holders = where.get(key)
                if holders is None:
                    where[key] = {address}
                else:
                    holders.add(address)
            seen[key] = now
        self._expire(address, now)

    def _expire(self, address: str, now: float) -> None:
        seen = self._last_seen.get(address)
        if not seen:
            return
        cutoff = now - self.window
        where = self._where
        while seen and next(iter(seen.values())) < cutoff:
            key, _ = seen.popitem(last=False)
            holders = where[key]
            holders.discard(address)
            if not holders:
                del where[key]

    def blocks(self, address: str, now: float) -> int:
        """Estimated distinct blocks in the endpoint's working set."""
        self._expire(address, now)
        return len(self._last_seen.get(address, ())) * self.sample

    def holds_all(self, sampled: frozenset[int]) -> dict[str, int]:
        """Per endpoint (those holding any): estimated blocks of the request already in its set.
        Expiry is per endpoint: call `blocks` for an endpoint first, as a pick does."""
        counts: dict[str, int] = {}
        where = self._where
        for key in sampled:
            holders = where.get(key)
            if holders:
                for address in holders:
                    counts[address] = counts.get(address, 0) + 1
        n = self.sample
        return {address: c * n for address, c in counts.items()}

    def forget(self, address: str) -> None:
        where = self._where
        for key in self._last_seen.pop(address, ()):
            holders = where[key]
            holders.discard(address)
            if not holders:
                del where[key]


@register
@dataclass
class PredictedLatencyScorer:
    """Score = fastest predicted TTFT among the candidates / this endpoint's predicted TTFT."""

    type_name: ClassVar[str] = "predicted-latency-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset(
        {Consumes.TOKENS, Consumes.KV_INDEX, Consumes.ADMISSIONS, Consumes.METRICS, Consumes.ADAPTERS}
    )
    name: str = type_name
    block_size: int = 16  # as the precise prefix scorer's: the default until events say
    recent_window_seconds: float = 2.0
    prior_seconds_per_token: float = 1 / 4000
    prior_seconds_per_step: float = 0.025
    # What a pick costs others, in multiples of its own prefill work: computing a prefix the
    # pool already holds elsewhere delays every request queued behind it there.
    work_penalty: float = 3.0
    # Cached blocks a pick would evict on a full engine, as future recompute work.
    eviction_penalty: float = 3.0
    # How long a prefix this replica routed somewhere counts as that engine's to keep cached.
    # Several times the gap between a prefix's requests at low load: at 4 req/s over llm-d's 64
    # prefixes one gap in four outlasted 20 s, the engines looked to hold fewer prefixes than
    # they did, and a fifth went onto engines that held four (hit 69% against the oracle's 72%).
    working_set_seconds: float = 60.0
    # Prompt tokens computed on an engine, charged again in proportion to its recent working
    # set over the candidates' mean: a prefix computed somewhere goes where the fewest prefixes
    # live, so prefixes spread evenly over the pool as they first appear (as a placement that
    # knows the groups in advance deals them) instead of wherever the queue is shortest then.
    # At 2, a new prefix still went where the queue was a few seconds shorter under overload, and
    # the pool ended up with three to six prefixes an engine where the oracle deals four.
    balance_penalty: float = 4.0
    # Learn each engine's speed apart (a pool of mixed accelerators) instead of the pool's one.
    per_endpoint_speed: bool = False
    prefix: PrecisePrefixCacheScorer = field(init=False)
    working_sets: WorkingSets = field(init=False)
    model: LatencyModel = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = PrecisePrefixCacheScorer(
            name=f"{self.name}/prefix",
            block_size=self.block_size,
            recent_window_seconds=self.recent_window_seconds,
        )
        self.model = LatencyModel(
            self.prior_seconds_per_token, self.prior_seconds_per_step, per_endpoint=self.per_endpoint_speed
        )
        self.working_sets = WorkingSets(self.working_set_seconds)

    def predict(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[str, float]:
        """Predicted seconds to first token per endpoint (also left in ctx.cache)."""
        fractions = self.prefix.cached_fractions(ctx, endpoints)
        servable = self.prefix.servable_fractions(ctx, endpoints)
        n = len(ctx.request.token_ids)
        full = n - n % self.block_size
        uncached = ctx.cache.setdefault(PREFILL_TOKENS, {})
        out: dict[str, float] = {}
        ttft_only: dict[str, float] = ctx.cache.setdefault(f"{self.name}:ttft-only", {})
        held_by: dict[str, int] | None = None  # request blocks each endpoint's working set has
        n_blocks = len(self.prefix.block_keys_for(ctx))
        # Fold in every new scrape first: the pool's estimate must be the same for every
        # candidate of one pick (updated mid-loop, it ranked candidates on different scales).
        speeds = {
            e.address: self.model.observe(e, ctx.datastore.index.block_size(e.address) or self.block_size)
            for e in endpoints
        }
        # every candidate's working set expired (blocks()) before any is read by holds_all()
        working_set_blocks = (
            {
                e.address: self.working_sets.blocks(e.address, ctx.now)
                for e in endpoints
                if e.metrics.kv_blocks_total or self.balance_penalty
            }
            if self.eviction_penalty or self.balance_penalty
            else {}
        )
        mean_held = (
            sum(working_set_blocks.values()) / len(working_set_blocks)
            if self.balance_penalty and working_set_blocks
            else 0.0
        )
        for e in endpoints:
            on_device = int(fractions[e.address] * full)
            mine = n - max(on_device, int(servable[e.address] * full))
            uncached[e.address] = mine
            speed = speeds[e.address]
            rate = self.model.estimate(speed)
            m = e.metrics
            ttft = self._estimate_ttft(e, speed, rate, mine)
            loaded = n - mine - on_device  # tokens its host tier gives back instead of compute
            if loaded > 0:
                ttft += loaded * self.model.copy_seconds_per_token(speed)
            extra = self.work_penalty * mine
            if mean_held > 0:
                extra += self.balance_penalty * mine * working_set_blocks[e.address] / mean_held
            if self.eviction_penalty and m.kv_blocks_total:
                # Blocks this request adds to what the engine must keep cached; past its
                # capacity, each one pushes out a block a recent request will want again.
                # The device pool's capacity, even with a host tier behind it: a working set
                # that overflows the device is served from copies, and its running requests'
                # blocks crowd one another out of the device, so its batches shrink (counting
                # the host tier's blocks here spread prefixes and cost 20% of the output on
                # llm-d-tiered at 16-24 req/s).
                capacity = m.kv_blocks_total
                held = working_set_blocks[e.address]
                if held + n_blocks > capacity:  # else nothing can overflow
                    if held_by is None:
                        held_by = self.working_sets.holds_all(self._sampled_keys(ctx))
                    new = max(0, n_blocks - held_by.get(e.address, 0))
                    overflow = held + new - capacity
                    extra += self.eviction_penalty * max(0, min(overflow, new)) * self.block_size
            ttft_only[e.address] = ttft
            out[e.address] = ttft + extra * rate.seconds_per_token
        ctx.cache[f"{self.name}:ttft"] = out
        return out

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        if not endpoints:
            return []
        predicted = self.predict(ctx, endpoints)
        best = min(predicted.values())
        scores = [best / predicted[e.address] if predicted[e.address] > 0 else 1.0 for e in endpoints]
        slo = ctx.request.slo_ttft_s
        if slo is not None:
            # Headroom first, as llm-d does: an endpoint predicted to meet the objective always
            # outranks one predicted to miss it; the order within each side stays.
            meets = [self._ttft(ctx, e) <= slo for e in endpoints]
            if any(meets):
                scores = [0.5 + s / 2 if ok else s / 2 for s, ok in zip(scores, meets, strict=True)]
        return scores

    def _ttft(self, ctx: SchedulingContext, e: EndpointState) -> float:
        """The predicted TTFT alone, without the costs charged to the pool."""
        return ctx.cache[f"{self.name}:ttft-only"][e.address]

    def pre_request(self, ctx: SchedulingContext, target: EndpointState) -> None:
        # The prompt counts as cached there until the engine has computed it (its predicted
        # TTFT) and its BlockStored had time to arrive: a request can wait many seconds in a
        # busy engine's queue, and its prefix must not be placed a second time meanwhile.
        ttft = ctx.cache.get(f"{self.name}:ttft-only", {}).get(target.address)
        until = None if ttft is None else ctx.now + ttft + self.recent_window_seconds
        self.prefix.pre_request(ctx, target, until)
        self.working_sets.touch(target.address, self._sampled_keys(ctx), ctx.now)
        tokens = ctx.cache.get(PREFILL_TOKENS, {}).get(target.address)
        if tokens is not None:
            self.model.speed(target.address).recent_uncached.append(tokens)

    def observe_admission(
        self,
        address: str,
        token_ids: list[int],
        now: float,
        index: PreciseIndex,
        lora_id: int | None = None,
        state: EndpointState | None = None,
    ) -> int:
        """Another EPP replica's pick, announced by the engine: it fills that engine's cache
        as our own picks do, and counts as cached there until that engine is predicted to have
        computed it, as ours do. Returns the tokens the engine must compute for it."""
        until = None if state is None else (lambda uncached: now + self._queue_seconds(state, uncached))
        keys, uncached = self.prefix.record_admission(address, token_ids, now, index, lora_id, until)
        self.working_sets.touch(address, self.working_sets.sampled(keys), now)
        return uncached

    def _estimate_ttft(self, e: EndpointState, speed: EndpointSpeed, rate: EndpointSpeed, mine: int) -> float:
        """Seconds until the endpoint has computed what is queued there and then `mine` more
        prompt tokens, and sampled the first token after them."""
        m = e.metrics
        # Queued work the engine reports (for an engine that does not, its waiting count times
        # the prompt sizes recently sent there), plus this replica's picks it cannot show yet.
        reported = (
            m.prefill_tokens_pending
            if m.prefill_tokens_pending is not None
            else m.waiting * speed.mean_uncached(mine)
        )
        work = reported + e.pending_prefill_tokens() + mine
        # The learnt per-token time already carries the decode steps interleaved with
        # prefill; the first token then takes one more step.
        return work * rate.seconds_per_token + rate.seconds_per_step

    def _queue_seconds(self, e: EndpointState, uncached: int) -> float:
        """The predicted TTFT of `uncached` more prompt tokens there, plus the recent-pick window
        (the time for its KV events)."""
        speed = self.model.speed(e.address)
        return (
            self._estimate_ttft(e, speed, self.model.estimate(speed), uncached) + self.recent_window_seconds
        )

    def _sampled_keys(self, ctx: SchedulingContext) -> frozenset[int]:
        cache_key = f"{self.name}:sampled-keys"
        found: frozenset[int] | None = ctx.cache.get(cache_key)
        if found is None:
            found = ctx.cache[cache_key] = self.working_sets.sampled(self.prefix.block_keys_for(ctx))
        return found

    def forget_endpoint(self, address: str) -> None:
        self.prefix.forget_endpoint(address)
        self.model.forget(address)
        self.working_sets.forget(address)


if TYPE_CHECKING:  # mypy holds the scorer to the contracts the profile resolves on it
    _contracts: tuple[type[EndpointForgetter], type[AdmissionObserver]] = (
        PredictedLatencyScorer,
        PredictedLatencyScorer,
    )

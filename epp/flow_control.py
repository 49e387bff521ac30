"""Flow control: requests held in the EPP and dispatched in the order priority and fairness say,
when the pool has room for them.

A flow is (fairness id, priority). Priority bands are served strictly, highest first. Inside a
band the backlogged flow whose tenant has received the least service goes next: service is
counted in tokens (virtual token counters, VTC: prompt tokens plus weighted output tokens, over
the tenant's weight), so a tenant of short prompts is not starved by one of huge prompts, and a
tenant that was idle is lifted to the least counter of the backlogged flows when it comes back,
so idleness banks no credit. Inside a flow: first come, first served.

A held request is dispatched when an endpoint that may serve it has room ("no-regret": placed
when it can run, not when it arrived), and the pick is made then, with the state of that
moment, among the endpoints that have room. Queues are bounded (per flow, in all, in bytes)
and every held request has a deadline: it ends with a dispatch or a clear 429/503, never
silently. The core here is synchronous and runs on any clock (the virtual pool drives it too);
``FlowGate`` runs it on an asyncio loop for the ext_proc server.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.epp.datastore import EndpointState
from kvgate.epp.director import Decision, Director
from kvgate.epp.recent_work import RecentWork
from kvgate.epp.request import InferenceRequest

log = logging.getLogger("kvgate.epp.flow_control")

DEFAULT_FAIRNESS_ID = "default"
# Counters kept for this many tenants at most; beyond, those with nothing queued are dropped
# (a tenant that comes back is lifted to the backlogged floor anyway, so little is lost).
MAX_TRACKED_TENANTS = 10_000


@dataclass(frozen=True)
class FlowControlConfig:
    enabled: bool = True
    # When a held request may go: "pool" (GIE's): while the pool is not saturated (its
    # saturation detector), picked among every candidate as without flow control, so prefix
    # affinity is untouched; "endpoint": while some endpoint has room for this request (below),
    # picked among those: tighter isolation between tenants, at the cost of placement.
    dispatch: str = "pool"
    max_queued: int = 50_000  # held requests, all flows together
    max_queued_per_flow: int = 10_000
    max_queued_bytes: int = 512 << 20  # request bodies held, all flows together
    ttl_s: float = 30.0  # a request held longer is answered 429 (sheddable) or 503
    # VTC's weights: an output token costs what two prompt tokens do.
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0
    # Output assumed at dispatch when the request sets no max_tokens; corrected at the end.
    default_output_tokens: int = 256
    # An endpoint has room while fewer requests than this wait there, in its own queue (an
    # engine admits what its batch can take: one that makes a request wait is full) ...
    dispatch_queue_depth: int = 1
    # ... and this replica has sent it fewer picks than this that no scrape shows yet ...
    max_unconfirmed_picks: int = 4
    # ... while its KV cache is less used than this ...
    dispatch_kv_utilization: float = 0.8
    # ... and, where the engine reports it (kvgate:prefill_tokens_pending), while less prompt
    # work than this is ahead of a new request there. 0: not checked.
    dispatch_prefill_tokens: int = 1024
    metrics_staleness_s: float = 2.0
    # Short requests (prompts of at most `short_prompt_tokens`) go where no prompt work is
    # ahead when some endpoint with room has none. Keep `short_reserve` endpoints free of long
    # prompts while short ones arrived within `short_window_s`: where every engine is busy
    # with long prefills, a short request waits seconds for the step in flight. 0: off.
    short_reserve: int = 0
    short_prompt_tokens: int = 1024
    short_window_s: float = 5.0
    # The engines run requests marked over their share after the others of their priority
    # (kvgate's engines do: --scheduling-policy fair). Then, with pool dispatch, the pool's
    # saturation holds only the flows that sent more than their share of the band's recent work
    # (prompt and output tokens dispatched, decayed with this half-life): a flow under its
    # share is run by its engine before the queued work that saturates the pool, so holding it
    # here would only add the wait for a gap. 0: saturation holds every flow, nothing is marked
    # (engines that serve in arrival order).
    fair_share_half_life_s: float = 10.0
    # ... while the engines' queues stay shorter than this on average (this replica's picks not
    # yet scraped included): past it every flow is held, so the EPP's bounds and TTL, not the
    # engines' unbounded queues, take an overload that the tenants share evenly.
    fair_share_max_queue: float = 20.0
    # A request whose flow sent more than this many times its weighted share of that recent
    # work is marked over its share: the engines run it after the others of its priority.
    over_share_factor: float = 1.5

    def __post_init__(self) -> None:
        if self.max_queued < 0 or self.max_queued_per_flow < 0 or self.max_queued_bytes < 0:
            raise ValueError("flow-control queue limits must be >= 0")
        if not self.ttl_s > 0 or math.isinf(self.ttl_s):
            raise ValueError("flow-control TTL must be a positive number of seconds")
        if self.dispatch not in ("pool", "endpoint"):
            raise ValueError(f"flow-control dispatch must be 'pool' or 'endpoint', not {self.dispatch!r}")
        if self.dispatch_queue_depth <= 0 or self.max_unconfirmed_picks <= 0:
            raise ValueError("flow-control dispatch queue depth and unconfirmed picks must be > 0")


def prompt_tokens(request: InferenceRequest) -> int:
    """The prompt tokens flow control charges and places a request by: the tokenizer's count,
    or without one (or where only the engine can tell) about 4 characters a token."""
    if request.body is None:
        return 0
    tokens = request.token_ids
    return len(tokens) if tokens else len(request.prompt_text) // 4


def footprint(body_bytes: int, prompt_tokens: int) -> int:
    """Memory a held request keeps, as --flow-max-queued-bytes counts it: its body as received
    and as parsed (measured at about 1.5x the raw bytes for chat and completion bodies), its
    prompt tokens compacted to 4 bytes each, and 1.5 KiB of bookkeeping (exchange, request, queue
    entry). tests/epp/test_flow_control.py checks it against traced memory."""
    return int(2.5 * body_bytes) + 4 * prompt_tokens + 1536


@dataclass(frozen=True, order=True)
class FlowKey:
    priority: int
    fairness_id: str


class Weights(Protocol):
    def weight(self, name: str) -> float: ...


class _EqualWeights:
    def weight(self, name: str) -> float:
        return 1.0


@dataclass(eq=False)
class Held:
    """One request in a flow's queue."""

    key: FlowKey
    request: InferenceRequest
    prompt_tokens: int
    output_estimate: int
    body_bytes: int  # what it holds in memory while queued (see `footprint`)
    enqueued: float
    deadline: float
    seq: int
    state: str = "queued"  # queued | dispatched | rejected | cancelled
    left_at: float = 0.0  # when it left the queue
    decision: Decision | None = None
    charged: float = 0.0
    tokens: array[int] | None = field(default=None, repr=False)  # its prompt, compact while held
    on_done: Callable[[Held], None] | None = field(default=None, repr=False)

    @property
    def sheddable(self) -> bool:
        return self.key.priority < 0

    @property
    def queued_seconds(self) -> float:
        return max(0.0, self.left_at - self.enqueued)


@dataclass
class _Band:
    flows: dict[str, deque[Held]] = field(default_factory=dict)


class FlowObserver(Protocol):
    """What the metrics are told (kvgate.epp.metrics implements it)."""

    def dispatched(self, key: FlowKey, queued_seconds: float) -> None: ...

    def rejected(self, key: FlowKey, reason: str) -> None: ...


class FlowController:
    def __init__(
        self,
        director: Director,
        config: FlowControlConfig | None = None,
        weights: Weights | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.director = director
        self.config = config or FlowControlConfig()
        self.weights = weights or _EqualWeights()
        self.clock = clock or director.clock
        self._bands: dict[int, _Band] = {}
        self._priorities: list[int] = []  # highest first
        self._deadlines: list[tuple[float, int, Held]] = []
        self._seq = itertools.count()
        self.counters: dict[str, float] = {}  # tenant -> service received / weight (VTC)
        # work dispatched lately, per flow and band (fair_share_half_life_s)
        self._recent = RecentWork(self.config.fair_share_half_life_s or 1.0, self.weights)
        self.queued = 0
        self.queued_bytes = 0
        self.observer: FlowObserver | None = None
        self._short_seen = -math.inf  # when a short request last arrived
        # Called with (tenant, weighted tokens) for every charge this replica makes, so other
        # replicas can be told (see note_remote_service).
        self.on_charge: Callable[[str, float], None] | None = None

    # -- what a request costs -------------------------------------------------------------
    def _output_estimate(self, request: InferenceRequest) -> int:
        body = request.body or {}
        for name in ("max_completion_tokens", "max_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return min(value, self.config.default_output_tokens)
        return self.config.default_output_tokens

    def _cost(self, prompt_tokens: int, output_tokens: int) -> float:
        c = self.config
        return c.prompt_token_weight * prompt_tokens + c.output_token_weight * output_tokens

    def _counter_cost(self, held: Held) -> float:
        """What dispatching `held` adds to its tenant's counter: its cost over the weight."""
        return self._cost(held.prompt_tokens, held.output_estimate) / self.weights.weight(
            held.key.fairness_id
        )

    def charge(self, tenant: str, tokens: float) -> None:
        """Count `tokens` (already weighted by kind) of service to `tenant`."""
        self._count(tenant, tokens)
        if self.on_charge is not None and tokens:
            self.on_charge(tenant, tokens)

    def note_remote_service(self, tenant: str, tokens: float) -> None:
        """Service another EPP replica gave `tenant`: counted as if given here, so that replicas
        that each hold part of the traffic keep one pool-wide notion of fair shares."""
        self._count(tenant, tokens)

    def _count(self, tenant: str, tokens: float) -> None:
        counters = self.counters
        if tenant not in counters and len(counters) >= MAX_TRACKED_TENANTS:
            backlogged = {t for band in self._bands.values() for t, q in band.flows.items() if q}
            for idle in [t for t in counters if t not in backlogged]:
                del counters[idle]
        counters[tenant] = counters.get(tenant, 0.0) + tokens / self.weights.weight(tenant)

    def completed(self, held: Held, output_tokens: int | None) -> None:
        """The request ended: replace the output estimate charged at dispatch with what it
        produced (None: not known, the estimate stands)."""
        if output_tokens is None or held.state != "dispatched":
            return
        delta = output_tokens - held.output_estimate
        if delta:
            self.charge(held.key.fairness_id, self.config.output_token_weight * delta)

    # -- room -----------------------------------------------------------------------------
    def has_room(self, state: EndpointState, now: float, tokens: int = 0, prompt_tokens: int = 0) -> bool:
        """Whether a request of `tokens` (prompt + expected output, `prompt_tokens` of them
        prompt) may go to this endpoint now (its metrics fresh): nothing waits there, its KV
        cache can hold the request, and little prompt work is ahead of it."""
        c = self.config
        m = state.metrics
        if state.draining or m.waiting >= c.dispatch_queue_depth or state.pending >= c.max_unconfirmed_picks:
            return False
        if m.kv_blocks_total:
            # In blocks, so a short request still fits where a long one would not: the room
            # left under the threshold must hold this request (16-token blocks if unknown).
            size = self.director.datastore.index.block_size(state.address) or 16
            free = (c.dispatch_kv_utilization - m.kv_usage) * m.kv_blocks_total
            if free < -(-tokens // size):
                return False
        elif m.kv_usage >= c.dispatch_kv_utilization:
            return False
        if c.dispatch_prefill_tokens and m.prefill_tokens_pending is not None:
            # The prompt work ahead of it there, with its own, within the limit; or none ahead
            # (a prompt longer than the limit goes where nothing else waits to prefill).
            ahead = self._prefill_ahead(state)
            return ahead == 0 or ahead + prompt_tokens <= c.dispatch_prefill_tokens
        return True

    def _roomy(self, held: Held, now: float) -> list[EndpointState] | None:
        """The candidates with room; None when no candidate's metrics are fresh: flow control
        cannot judge room then, and holds nothing (the pick proceeds as without it)."""
        candidates = self.director.candidates(held.request)
        fresh = [e for e in candidates if e.age(now) <= self.config.metrics_staleness_s]
        if not fresh:
            return None
        if self.config.dispatch == "pool":
            return (
                [] if self.director.saturation.saturated(self.director.datastore.all(), now) else candidates
            )
        tokens = held.prompt_tokens + held.output_estimate
        roomy = [e for e in fresh if self.has_room(e, now, tokens, held.prompt_tokens)]
        if held.prompt_tokens <= self.config.short_prompt_tokens:
            # A short request waits for whatever prompt work is ahead of it, and a cache hit
            # could save it little (at most its own short prompt): where some endpoint has no
            # prompt work ahead, it goes there.
            return [e for e in roomy if self._prefill_ahead(e) == 0] or roomy
        reserve = self.config.short_reserve
        if not reserve or not roomy or len(fresh) <= reserve:
            return roomy  # (a pool no larger than the reserve keeps nothing back)
        if now - self._short_seen > self.config.short_window_s:
            return roomy  # no short traffic lately: nothing to keep room for
        # A long prompt keeps its engine's steps long for seconds; a short request landing
        # there waits for them. While short requests keep arriving, the last `reserve`
        # endpoints with no prompt work at all are kept for them.
        idle = [e for e in fresh if self._prefill_ahead(e) < self.config.short_prompt_tokens]
        if len(idle) > reserve:
            return roomy
        kept = {e.address for e in idle}
        return [e for e in roomy if e.address not in kept]

    def _past_saturation(self, held: Held) -> list[EndpointState]:
        """Where an under-share flow's request may go while the pool is saturated: any candidate,
        unless the engines' queues are past fair_share_max_queue."""
        candidates = [e for e in self.director.candidates(held.request) if not e.draining]
        if not candidates:
            return []
        waiting = sum(e.waiting_after_picks() for e in candidates)
        if waiting / len(candidates) >= self.config.fair_share_max_queue:
            return []
        return candidates

    def _share_ratio(self, key: FlowKey, band: _Band | None, now: float) -> float | None:
        """This flow's recent work over its weighted share of its band's and the bands' below
        (kvgate.epp.recent_work); None while the rule is off or nothing was sent."""
        if not self.config.fair_share_half_life_s:
            return None
        queued = (t for t, queue in band.flows.items() if queue) if band is not None else ()
        return self._recent.ratio(key.priority, key.fairness_id, queued, now)

    def _passes_saturation(self, key: FlowKey, ratio: float | None) -> bool:
        """Whether a flow at this share ratio goes past a saturated pool (pool dispatch, under
        its share). Sheddable work never does: GIE holds it back while saturated."""
        return ratio is not None and ratio < 1 and self.config.dispatch == "pool" and key.priority >= 0

    @staticmethod
    def _prefill_ahead(state: EndpointState) -> int:
        pending = state.metrics.prefill_tokens_pending
        return (pending or 0) + state.pending_prefill_tokens()

    # -- submission -----------------------------------------------------------------------
    def submit(
        self, request: InferenceRequest, body_bytes: int = 0, on_done: Callable[[Held], None] | None = None
    ) -> Held:
        """Queue a request (and dispatch what can go now, this one maybe). The returned
        `Held` ends dispatched (its `decision` routed), rejected (`decision` the 429/503) or
        cancelled; `on_done` is called once when it leaves the queue."""
        now = self.clock()
        c = self.config
        key = FlowKey(request.priority, request.fairness_id or DEFAULT_FAIRNESS_ID)
        prompt = prompt_tokens(request)
        held = Held(
            key,
            request,
            prompt,
            self._output_estimate(request) if request.body is not None else 0,
            footprint(body_bytes, prompt),
            now,
            now + c.ttl_s,
            next(self._seq),
            on_done=on_done,
        )
        band = self._bands.get(key.priority)
        flow = band.flows.get(key.fairness_id) if band is not None else None
        if flow is not None and len(flow) >= c.max_queued_per_flow:
            self._reject(
                held,
                "flow_queue_full",
                429,
                f"flow {key.fairness_id!r} already has {len(flow)} requests queued",
            )
            return held
        if self.queued >= c.max_queued or self.queued_bytes + held.body_bytes > c.max_queued_bytes:
            self._reject(
                held, "queue_full", 429 if held.sheddable else 503, "the endpoint picker's queues are full"
            )
            return held
        if held.sheddable:
            # GIE's contract for sheddable work: refused at once while the pool has no room
            # for it, rather than held (the client learns now, and retries later or elsewhere).
            roomy = self._roomy(held, now)
            if roomy is not None and not roomy:
                self._reject(
                    held,
                    "saturated",
                    429,
                    f"pool saturated; objective {request.objective!r} (priority {key.priority}) is sheddable",
                )
                return held
        if band is None:
            band = self._bands[key.priority] = _Band()
            self._priorities = sorted(self._bands, reverse=True)
        if flow is None:
            flow = band.flows[key.fairness_id] = deque()
        if not flow:
            self._level(band, key.fairness_id, self._counter_cost(held))
        if 0 < held.prompt_tokens <= c.short_prompt_tokens:
            # At arrival, not when a dispatch round looks at it: a short request held behind
            # others (by fairness) still needs the reserve kept for it.
            self._short_seen = now
        flow.append(held)
        self.queued += 1
        self.queued_bytes += held.body_bytes
        if request._token_ids:  # 4 bytes a token while it waits, not a list of int objects
            held.tokens = array("i", request._token_ids)
            request._token_ids = None
        heapq.heappush(self._deadlines, (held.deadline, held.seq, held))
        if self.queued == 1 or self._passes_saturation(key, self._share_ratio(key, band, now)):
            # Nothing else was waiting, or its flow may pass a saturated pool: it may go at
            # once. Otherwise the last round found no room, and the next one (a scrape, a
            # finished request, the tick) decides; a round per arrival would cost every arrival
            # a look at every flow while the pool is full.
            self.dispatch()
        return held

    def _level(self, band: _Band, tenant: str, head_cost: float) -> None:
        """A flow that becomes backlogged starts level with the least-served flow already
        backlogged in its band, within its own next request: service it did not ask for while
        idle is not owed to it (VTC's lift), and service it got while no one else asked is not
        held against it (without that, a light tenant that used an idle pool waited for every
        newcomer to catch up, blocked behind their ceiling)."""
        others = [self.counters.get(t, 0.0) for t, q in band.flows.items() if q and t != tenant]
        if others:
            floor = min(others)
            self.counters[tenant] = min(max(self.counters.get(tenant, 0.0), floor), floor + head_cost)

    def cancel(self, held: Held) -> None:
        """The client (or Envoy) gave up while the request was held."""
        if held.state == "queued":
            self._remove(held)
            held.state = "cancelled"
            self._done(held)

    # -- dispatch -------------------------------------------------------------------------
    def dispatch(self) -> list[Held]:
        """Send every held request that can go now, in priority then fairness order; returns
        them. Also ends the requests whose deadline has passed."""
        now = self.clock()
        self._expire(now)
        sent: list[Held] = []
        if not self.queued:
            return sent
        for priority in self._priorities:
            band = self._bands[priority]
            blocked: set[str] = set()  # flows whose head has no endpoint with room this round
            # Flows behind a blocked one may go ahead (the pool stays busy) only while their
            # counters stay within one request of it: a tenant whose requests are too large for
            # the room that opens is not overtaken for ever (that room accumulates for it).
            ceiling = math.inf
            while True:
                tenant = self._next_flow(band, blocked)
                if tenant is None or self.counters.get(tenant, 0.0) > ceiling:
                    break
                flow = band.flows[tenant]
                held = flow[0]
                roomy = self._roomy(held, now)
                ratio = self._share_ratio(held.key, band, now)
                if roomy is not None and not roomy and self._passes_saturation(held.key, ratio):
                    roomy = self._past_saturation(held)
                if roomy is not None and not roomy:
                    blocked.add(tenant)
                    ceiling = min(ceiling, self.counters.get(tenant, 0.0) + self._counter_cost(held))
                    continue
                self._remove(held)
                held.request.over_share = ratio is not None and ratio > self.config.over_share_factor
                try:
                    decision = self.director.pick(held.request, among=roomy)
                except Exception:
                    log.exception("request %s: scheduler failed", held.request.request_id)
                    decision = Decision(500, reason="the endpoint picker failed to schedule this request")
                held.decision = decision
                if decision.routed:
                    held.state = "dispatched"
                    self._note_prefill(decision.targets[0], held.prompt_tokens)
                    held.charged = self._cost(held.prompt_tokens, held.output_estimate)
                    self.charge(tenant, held.charged)
                    if self.config.fair_share_half_life_s:
                        self._recent.add(held.key.priority, tenant, held.charged, now)
                    if self.observer is not None:
                        self.observer.dispatched(held.key, now - held.enqueued)
                else:
                    held.state = "rejected"
                    if self.observer is not None:
                        self.observer.rejected(held.key, f"pick_{decision.status}")
                sent.append(held)
                self._done(held)
            if blocked and any(band.flows[t] for t in blocked):
                # Strict priority: lower bands wait while this one holds work that has no room.
                # (Work for another model whose endpoints have room is not held up: its flow
                # is tried in its own band first, and a band only blocks the ones below.)
                break
        return sent

    def _note_prefill(self, address: str, prompt_tokens: int) -> None:
        """The pick just recorded there counts its whole prompt as prefill work ahead of the
        next request until a scrape shows it, unless a scorer knew better (cache hits)."""
        state = self.director.datastore.get(address)
        if state is not None and state.pending_tokens and state.pending_tokens[-1] == 0:
            state.set_last_pick_tokens(prompt_tokens)

    def _next_flow(self, band: _Band, blocked: set[str]) -> str | None:
        best: str | None = None
        best_key: tuple[float, int] | None = None
        for tenant, flow in band.flows.items():
            if not flow or tenant in blocked:
                continue
            k = (self.counters.get(tenant, 0.0), flow[0].seq)
            if best_key is None or k < best_key:
                best, best_key = tenant, k
        return best

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and (heap[0][2].state != "queued" or heap[0][0] <= now):
            _, _, held = heapq.heappop(heap)
            if held.state != "queued":
                continue
            self._remove(held)
            self._reject(
                held,
                "ttl_expired",
                429 if held.sheddable else 503,
                f"held {now - held.enqueued:.1f}s in the endpoint picker's queue without room in the pool "
                f"(TTL {self.config.ttl_s:g}s)",
            )

    def _remove(self, held: Held) -> None:
        band = self._bands[held.key.priority]
        flow = band.flows[held.key.fairness_id]
        if flow and flow[0] is held:
            flow.popleft()
        else:
            flow.remove(held)
        if not flow:
            del band.flows[held.key.fairness_id]
        self.queued -= 1
        self.queued_bytes -= held.body_bytes
        if held.tokens is not None:
            held.request._token_ids = held.tokens.tolist()
            held.tokens = None
        held.left_at = self.clock()

    def _reject(self, held: Held, reason: str, status: int, message: str) -> None:
        held.state = "rejected"
        held.decision = Decision(
            status,
            reason=message,
            error_type="rate_limit_exceeded" if status == 429 else "service_unavailable",
        )
        # Saturation is judged again on every scrape (tens of ms), so a sheddable request refused
        # for it may come back after the shortest Retry-After there is; a full queue or a TTL
        # spent says the overload lasts, and asks for a tenth of the TTL.
        wait = 1 if reason == "saturated" else math.ceil(self.config.ttl_s / 10)
        held.decision.retry_after = max(1, wait)
        if self.observer is not None:
            self.observer.rejected(held.key, reason)
        self._done(held)

    def _done(self, held: Held) -> None:
        if held.on_done is not None:
            callback, held.on_done = held.on_done, None
            callback(held)

    def queue_sizes(self) -> dict[FlowKey, int]:
        return {FlowKey(p, t): len(q) for p, band in self._bands.items() for t, q in band.flows.items() if q}


class FlowGate:
    """The controller on an asyncio loop: `admit` waits for a request's dispatch (or its 429/503)
    while dispatch rounds run whenever something may have made room."""

    def __init__(self, controller: FlowController, tick_s: float = 0.01) -> None:
        self.controller = controller
        self.tick_s = tick_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def admit(self, request: InferenceRequest, body_bytes: int = 0) -> Held:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Held] = loop.create_future()

        def resolve(held: Held) -> None:
            if not done.done():
                done.set_result(held)

        held = self.controller.submit(request, body_bytes, on_done=resolve)
        if held.state == "queued":
            self._ensure_running()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self.controller.cancel(held)
            if held.state == "dispatched" and held.decision is not None:
                # picked at the instant the stream went away: give the slot back
                self.controller.director.finished(held.decision.targets[0])
            raise
        return held

    def poke(self) -> None:
        """Something may have made room (a request finished, a scrape came in)."""
        self._wake.set()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-flow-dispatch")

    async def _run(self) -> None:
        controller = self.controller
        while controller.queued:
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                controller.dispatch()
            except Exception:  # a bug here must not strand every held request
                log.exception("flow-control dispatch failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

"""The datastore: everything signal collectors learn, and the only thing the scheduler reads.

Collectors (discovery, metrics scraper, KV-event subscribers) write; the scheduler reads a
consistent enough view without locks because everything runs on one asyncio loop.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvgate.api.contracts.admissions import Admission
from kvgate.api.contracts.disaggregation import ROLE_BOTH
from kvgate.epp.prefix_index import PreciseIndex


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str  # "ip:port" as Envoy's ORIGINAL_DST cluster reads it
    kv_events: str | None = None  # ZMQ PUB address, e.g. tcp://10.0.0.7:5557
    kv_replay: str | None = None  # ZMQ ROUTER replay address, when the engine offers one
    name: str = ""  # pod name in Kubernetes; informative only
    # prefill | decode | both (kvgate.api.contracts.disaggregation): which side of a
    # disaggregated request it serves; a prefill-only endpoint is never a destination
    role: str = ROLE_BOTH


@dataclass(slots=True)
class EndpointMetrics:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    max_lora: int = 0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    updated_at: float = 0.0  # monotonic; 0 = never scraped
    consecutive_failures: int = 0
    draining: bool = False  # the engine says it is shutting down (kvgate:draining 1)
    sent_at: float = 0.0  # monotonic time the scrape request was sent; 0 = unknown (= updated_at)
    # Prompt tokens the engine still has to prefill (kvgate:prefill_tokens_pending); None when the
    # engine does not say (vLLM): estimated from its waiting count instead.
    prefill_tokens_pending: int | None = None
    kv_blocks_total: int | None = None  # the engine's KV pool (vllm:cache_config_info num_gpu_blocks)
    max_num_seqs: int = 0  # the engine's batch slots (kvgate:max_num_seqs); 0: not exported
    # Counters the latency model learns engine speed from (None: not exported).
    prompt_tokens_total: float | None = None  # vllm:prompt_tokens_total
    prefix_hits_total: float | None = None  # vllm:prefix_cache_hits_total (tokens)
    # tokens a KV connector supplied instead of compute: the host KV tier's loads, P/D pulls
    external_hits_total: float | None = None  # vllm:external_prefix_cache_hits_total
    # The host KV tier (vllm:cache_config_info num_cpu_blocks; None: none) and what copying
    # to and from it costs: kvgate:kv_offload_seconds_total over the blocks copied
    # (kvgate:kv_offload_stores_total + kvgate:kv_offload_loads_total).
    host_kv_blocks_total: int | None = None
    kv_copy_seconds_total: float | None = None
    kv_blocks_copied_total: float | None = None
    itl_seconds_sum: float | None = None  # vllm:inter_token_latency_seconds_sum
    itl_count: float | None = None  # vllm:inter_token_latency_seconds_count
    # Successful runtime LoRA loads + unloads (http_requests_total of those two handlers, 2xx):
    # when it moves, the engine's GET /v1/models changed. None: not exported.
    adapter_changes: float | None = None
    # The part of waiting / running / prefill_tokens_pending that is sheddable work, which the
    # engine preempts for a default-priority arrival (kvgate:*_sheddable; 0 where not exported).
    sheddable_waiting: int = 0
    sheddable_running: int = 0
    sheddable_prefill_tokens: int = 0

    @property
    def has_sheddable(self) -> bool:
        return bool(self.sheddable_waiting or self.sheddable_running or self.sheddable_prefill_tokens)

    def without_sheddable(self) -> EndpointMetrics:
        """These metrics as a request the engine ranks above sheddable work sees the engine."""
        pending = self.prefill_tokens_pending
        return dataclasses.replace(
            self,
            waiting=max(0, self.waiting - self.sheddable_waiting),
            running=max(0, self.running - self.sheddable_running),
            prefill_tokens_pending=None
            if pending is None
            else max(0, pending - self.sheddable_prefill_tokens),
            sheddable_waiting=0,
            sheddable_running=0,
            sheddable_prefill_tokens=0,
        )

    def has_adapter(self, name: str) -> bool:
        """The engine reports the adapter running or waiting (vllm:lora_requests_info)."""
        return name in self.running_loras or name in self.waiting_loras


# A pick shows in the engine's own counts only once Envoy has forwarded the request and the
# engine has admitted it; a scrape sent sooner than this after the pick (or, from an engine that
# announces admissions, after its admission) may not show it yet.
PICK_SETTLE_SECONDS = 0.025
# From an engine that announces admissions, a pick whose admission has not been heard of after
# this long counts as shown anyway (its request went elsewhere, or the announcement was lost).
PICK_ADMISSION_WAIT_SECONDS = 1.0
# Picks never confirmed by a scrape (the endpoint stopped answering) are forgotten after this.
PICK_MAX_AGE_SECONDS = 5.0


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    # Requests this EPP routed here whose responses have not finished. Exact only when Envoy
    # sends the response phase to the EPP (opt-in); the datastore trusts it only once a
    # response message has been seen (Datastore.inflight_tracked).
    inflight: int = 0
    # Monotonic times of this replica's picks that no scrape can show yet: the load signal that
    # needs no response phase and stays right with several EPP replicas (each adds only its own
    # picks to the engine-reported counts every replica sees).
    pending_picks: deque[float] = field(default_factory=deque)
    # The prefill tokens each of those picks brings (aligned with pending_picks; 0 = unknown).
    pending_tokens: deque[int] = field(default_factory=deque)
    # Their sum, kept as they come and go: every pick reads it once per candidate.
    pending_tokens_total: int = 0
    # When the engine's announcements of our own picks' admissions arrived, oldest first, not yet
    # matched with a scrape sent after them; and whether this engine announces admissions at all.
    own_admissions: deque[float] = field(default_factory=deque)
    announces_admissions: bool = False
    health_unavailable: bool = False  # the last /health probe answered 503
    kv_events_live: bool = False  # the subscriber is connected and in sequence
    kv_synced: bool = False  # the KV-event subscription finished (or gave up) its initial replay
    served_models: frozenset[str] = frozenset()  # names its GET /v1/models lists
    served_adapters: frozenset[str] = frozenset()  # those of them that are LoRA adapters (a parent)
    max_model_len: int = 0  # its context in tokens, from GET /v1/models; 0: not known
    address: str = ""  # = endpoint.address; a plain field because scorers read it per endpoint

    def __post_init__(self) -> None:
        self.address = self.endpoint.address
        self.kv_synced = self.kv_synced or self.endpoint.kv_events is None  # nothing to replay

    def age(self, now: float) -> float:
        m = self.metrics
        return float("inf") if m.updated_at == 0.0 else now - m.updated_at

    @property
    def draining(self) -> bool:
        return self.metrics.draining or self.health_unavailable

    @property
    def pending(self) -> int:
        return len(self.pending_picks)

    def note_pick(self, now: float, prefill_tokens: int = 0) -> None:
        picks, tokens = self.pending_picks, self.pending_tokens
        picks.append(now)
        tokens.append(prefill_tokens)
        self.pending_tokens_total += prefill_tokens
        while picks and picks[0] < now - PICK_MAX_AGE_SECONDS:
            picks.popleft()
            self.pending_tokens_total -= tokens.popleft()

    def set_last_pick_tokens(self, prefill_tokens: int) -> None:
        """Correct the prefill tokens of the pick made last."""
        tokens = self.pending_tokens
        if tokens:
            self.pending_tokens_total += prefill_tokens - tokens[-1]
            tokens[-1] = prefill_tokens

    def confirm_picks(self, scrape_sent: float) -> None:
        """Forget the picks a scrape sent at ``scrape_sent`` shows. From an engine that announces
        admissions: one per admission heard a settle time before the scrape (a pick whose
        request has not reached the engine yet, behind Envoy or the engine's own parsing of a
        long prompt, stays counted), or made PICK_ADMISSION_WAIT_SECONDS before it. Otherwise:
        every pick made a settle time before the scrape."""
        picks, tokens, admitted = self.pending_picks, self.pending_tokens, self.own_admissions
        cutoff = scrape_sent - PICK_SETTLE_SECONDS
        if self.announces_admissions:
            while picks and admitted and admitted[0] <= cutoff:
                picks.popleft()
                self.pending_tokens_total -= tokens.popleft()
                admitted.popleft()
            cutoff = scrape_sent - PICK_ADMISSION_WAIT_SECONDS
        while picks and picks[0] <= cutoff:
            picks.popleft()
            self.pending_tokens_total -= tokens.popleft()
        while len(admitted) > len(picks):
            admitted.pop()

    def note_own_admission(self, now: float) -> None:
        """The engine admitted one of this replica's picks (announced before its metrics show it)."""
        self.announces_admissions = True
        if len(self.own_admissions) < len(self.pending_picks):
            self.own_admissions.append(now)

    def pending_prefill_tokens(self) -> int:
        """Prefill tokens of this replica's picks that no scrape shows yet."""
        return self.pending_tokens_total

    def queue(self) -> int:
        """Waiting requests: the engine's queue plus our picks it cannot show yet."""
        return self.metrics.waiting + len(self.pending_picks)

    def waiting_after_picks(self) -> int:
        """The requests that will wait there once our not-yet-visible picks arrive: those picks
        take the engine's free batch slots first (kvgate:max_num_seqs less what runs and
        waits), and only the rest wait. An engine that does not say its slots (vLLM): every
        such pick counts as waiting, as queue() does. What saturation judges by: a burst of
        short requests to an engine with free slots runs at once, it does not queue."""
        m = self.metrics
        if not m.max_num_seqs:
            return self.queue()
        free = max(0, m.max_num_seqs - m.running - m.waiting)
        return m.waiting + max(0, len(self.pending_picks) - free)

    def load(self, inflight_tracked: bool = False) -> int:
        """Requests on the endpoint: scraped running + waiting plus our not-yet-visible picks,
        or our own in-flight count when the response phase keeps it exact and it is larger."""
        m = self.metrics
        load = m.waiting + m.running + len(self.pending_picks)
        return max(load, self.inflight) if inflight_tracked else load


Listener = Callable[[Endpoint, bool], None]  # (endpoint, added?)
AdmissionListener = Callable[[str, Admission], None]  # (endpoint address, what it admitted)


class Datastore:
    def __init__(self, unreachable_after_failures: int = 3, replica_id: str | None = None) -> None:
        self._states: dict[str, EndpointState] = {}
        # Names this replica's picks to the engines, which announce them to every replica
        # (kvgate.api.contracts.admissions); random, so replicas never share one.
        self.replica_id = replica_id or secrets.token_hex(6)
        self._admission_listeners: list[AdmissionListener] = []
        self.index = PreciseIndex()
        self.synced = False  # discovery has delivered its first full endpoint list
        # Envoy sends this EPP the response phase, so EndpointState.inflight is exact
        self.inflight_tracked = False
        self.unreachable_after_failures = unreachable_after_failures
        self._listeners: list[Listener] = []

    # -- what the pool serves (GET /v1/models on each endpoint) ---------------------------------
    def known_models(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for state in self._states.values():
            out |= state.served_models
        return out

    def known_adapters(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for state in self._states.values():
            out |= state.served_adapters
        return out

    def context_limit(self) -> int:
        """The longest context any endpoint serves (0: none reported): a prompt longer than
        this fits nowhere in the pool."""
        return max((s.max_model_len for s in self._states.values()), default=0)

    # -- discovery ---------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def subscribe_admissions(self, listener: AdmissionListener) -> None:
        self._admission_listeners.append(listener)

    def note_admission(self, address: str, admission: Admission, now: float | None = None) -> None:
        """An engine admitted a request some EPP replica picked. Our own pick (recorded when we
        made it) is now in the engine's counts, so a later scrape confirms it; another replica's
        is news. ``now``: when it arrived, on the clock picks and scrapes use."""
        state = self._states.get(address)
        if state is None:
            return
        if admission.picked_by == self.replica_id:
            state.note_own_admission(time.monotonic() if now is None else now)
            return
        state.announces_admissions = True
        for listener in self._admission_listeners:
            listener(address, admission)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = {e.address: e for e in endpoints}
        for address in list(self._states):
            if address not in wanted or wanted[address] != self._states[address].endpoint:
                self.remove(address)
        for address, endpoint in wanted.items():
            if address not in self._states:
                self.add(endpoint)
        self.synced = True

    def add(self, endpoint: Endpoint) -> None:
        if endpoint.address in self._states:
            return
        self._states[endpoint.address] = EndpointState(endpoint)
        for listener in self._listeners:
            listener(endpoint, True)

    def remove(self, address: str) -> None:
        state = self._states.pop(address, None)
        if state is None:
            return
        self.index.clear(address)
        for listener in self._listeners:
            listener(state.endpoint, False)

    # -- reads -------------------------------------------------------------------------------
    def get(self, address: str) -> EndpointState | None:
        return self._states.get(address)

    def all(self) -> list[EndpointState]:
        return list(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def reachable(self, state: EndpointState) -> bool:
        """A candidate for new requests: scraped, answering, and not shutting down."""
        m = state.metrics
        return (
            m.updated_at != 0.0
            and m.consecutive_failures < self.unreachable_after_failures
            and not m.draining
            and not state.health_unavailable
        )

    # -- writes (scraper) --------------------------------------------------------------------
    def update_metrics(self, address: str, metrics: EndpointMetrics) -> None:
        state = self._states.get(address)
        if state is not None:
            state.metrics = metrics
            state.confirm_picks(metrics.sent_at or metrics.updated_at)

    def scrape_failed(self, address: str) -> None:
        state = self._states.get(address)
        if state is not None:
            state.metrics.consecutive_failures += 1


def now() -> float:
    return time.monotonic()

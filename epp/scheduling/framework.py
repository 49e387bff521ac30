"""Plugin interfaces and the profile that runs them (GIE's filter / scorer / picker split)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kvgate.epp.datastore import Datastore, EndpointState
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.registry import Consumes, union

if TYPE_CHECKING:
    from kvgate.epp.prefix_index import PreciseIndex

# ctx.cache key: {address: prompt tokens the request would have to prefill there}, published by
# the prefix-aware scorers; the director records the chosen one's with the pick (load estimates).
PREFILL_TOKENS = "prefill-tokens"


@dataclass
class SchedulingContext:
    request: InferenceRequest
    datastore: Datastore
    now: float  # monotonic seconds, one clock reading per request
    # plugin name -> seconds spent; read by the metrics exporter
    plugin_seconds: dict[str, float] = field(default_factory=dict)
    # shared per-request scratch space (e.g. block keys computed once, used by several plugins)
    cache: dict[str, Any] = field(default_factory=dict)


class Plugin(Protocol):
    type_name: ClassVar[str]  # GIE's plugin type, what the config's `type:` names
    consumes: ClassVar[frozenset[Consumes]]  # the signals it reads (registry.Consumes)
    name: str


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]: ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        """One score in [0, 1] per endpoint, in the same order."""
        ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        """The chosen endpoint first, then fallbacks (possibly none)."""
        ...


@runtime_checkable
class PreRequest(Plugin, Protocol):
    """Told which endpoint a request was sent to (e.g. to remember where a prefix went)."""

    def pre_request(self, ctx: SchedulingContext, target: EndpointState) -> None: ...


@runtime_checkable
class EndpointForgetter(Protocol):
    """Keeps something per endpoint (recent picks, learned speeds) that dies with it: told when
    an endpoint leaves the pool, so a new pod on its ip:port inherits nothing."""

    def forget_endpoint(self, address: str) -> None: ...


@runtime_checkable
class AdmissionObserver(Protocol):
    """Counts another EPP replica's pick, announced by the engine that admitted it, as its own
    pick would have been counted, so active-active replicas judge queues and placement alike."""

    def observe_admission(
        self,
        address: str,
        token_ids: list[int],
        now: float,
        index: PreciseIndex,
        lora_id: int | None = None,
        state: EndpointState | None = None,
    ) -> int:
        """The prompt tokens the engine must compute for it (the rest it holds cached)."""
        ...


@dataclass
class ProfileResult:
    targets: list[EndpointState]  # empty: filters left nothing
    scores: dict[str, float]  # chosen address -> weighted total
    breakdown: dict[str, dict[str, float]]  # chosen address -> scorer name -> score
    filtered_out: int


@dataclass
class SchedulingProfile:
    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    _pre_request: list[PreRequest] = field(default_factory=list, repr=False)
    forgetters: list[EndpointForgetter] = field(default_factory=list, repr=False)
    admission_observers: list[AdmissionObserver] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # resolved once here: isinstance() against a Protocol costs microseconds per call
        self._pre_request = [p for p in self.plugins() if isinstance(p, PreRequest)]
        scorers = [s for s, _ in self.scorers]
        self.forgetters = [s for s in scorers if isinstance(s, EndpointForgetter)]
        self.admission_observers = [s for s in scorers if isinstance(s, AdmissionObserver)]

    def consumes(self) -> frozenset[Consumes]:
        """What its plugins declare they consume: the data sources the EPP must build for it."""
        return union(self.plugins())

    def plugins(self) -> list[Plugin]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker]

    def run(self, ctx: SchedulingContext, candidates: list[EndpointState]) -> ProfileResult:
        timings = ctx.plugin_seconds
        clock = time.perf_counter
        endpoints = candidates
        for f in self.filters:
            t0 = clock()
            endpoints = f.filter(ctx, endpoints)
            timings[f.name] = clock() - t0
            if not endpoints:
                return ProfileResult([], {}, {}, len(candidates))
        totals = [0.0] * len(endpoints)
        per_scorer: list[tuple[str, list[float]]] = []
        for scorer, weight in self.scorers:
            t0 = clock()
            # clamped: one plugin's bug must not dominate the sum
            scores = [0.0 if s < 0.0 else 1.0 if s > 1.0 else s for s in scorer.score(ctx, endpoints)]
            timings[scorer.name] = clock() - t0
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
            per_scorer.append((scorer.name, scores))
        t0 = clock()
        targets = self.picker.pick(ctx, endpoints, totals)
        timings[self.picker.name] = clock() - t0
        # the per-scorer breakdown is only kept for the chosen endpoints (logs, debugging)
        index = {id(e): i for i, e in enumerate(endpoints)}
        breakdown = {t.address: {name: sc[index[id(t)]] for name, sc in per_scorer} for t in targets}
        scores_by_address = {t.address: totals[index[id(t)]] for t in targets}
        return ProfileResult(targets, scores_by_address, breakdown, len(candidates) - len(endpoints))

    def pre_request(self, ctx: SchedulingContext, target: EndpointState) -> None:
        for plugin in self._pre_request:
            plugin.pre_request(ctx, target)

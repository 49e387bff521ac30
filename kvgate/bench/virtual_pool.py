"""A routing simulator on a virtual clock: the real EPP (Director, profiles, datastore, precise
index) in front of real engine schedulers and KV cache managers (the `--simulate` runner), with
time advanced event by event instead of slept.

The process bench (`kvgate bench --simulate`) is the truth, with Envoy, HTTP and every process;
on this machine it takes minutes per rate and its Python overheads blur fast timescales. This
runs the same routing decisions against the same engine scheduling in seconds, deterministically,
so a scorer can be studied across many rates and seeds — and the process bench then confirms.

What is modelled: Poisson arrivals; each engine steps whenever it has work, a step taking the
simulated runner's duration; the EPP scrapes every engine every `scrape_interval` (waiting,
running, KV use — what the real scraper reads) and receives each step's KV events
`kv_event_delay` later; several EPP replicas can share the pool (arrivals alternate between
them, as Envoy balances), each learning the others' picks from the engines' admission
announcements `admission_delay` after they are made. What is not: network and process overheads, HTTP streaming.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import heapq
import itertools
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvgate.api.contracts.admissions import Admission
from kvgate.api.lora import lora_int_id
from kvgate.bench.workloads import BenchRequest, WorkloadSpec, generate
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.flow_control import FlowControlConfig, FlowController, Held
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.predicted_latency_scorer import PredictedLatencyScorer

MODEL = "sim"
# Not a router: a clairvoyant reference that deals each group of the workload (a shared system
# prompt, a conversation, an adapter) to one engine for the whole run, in order of first
# appearance, round-robin. Every prefix is computed once, never moved, and the engines hold
# equally many groups: the placement a prefix-affinity router aims for, known in advance.
# What it reaches is the ceiling of routing by placement on this pool; what it misses (a
# prefix evicted by its own engine's traffic, a queue behind a hot group) no placement fixes.
ORACLE = "oracle-partition"
START = 1.0  # virtual time of the first scrape (0.0 means "never scraped" to the datastore)


def word_token(word: str, vocab: int = 49152) -> int:
    """A stable token id per workload word (the bench's words are one token each)."""
    digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return 1000 + int.from_bytes(digest, "little") % (vocab - 1000)


@dataclass
class PoolSpec:
    engines: int = 16
    block_size: int = 16
    kv_blocks: int = 1800
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Requests that name no tenant are dealt round-robin to this many ("tenant-0", ...); 0: none.
    tenants: int = 0
    # the engines' waiting order and prefill cap for long prompts (EngineConfig's defaults)
    scheduling_policy: str = EngineConfig.scheduling_policy
    long_prefill_token_threshold: int = EngineConfig.long_prefill_token_threshold
    sim: SimulationConfig = field(
        default_factory=lambda: SimulationConfig(
            prefill_time_per_token=0.0004, itl_base=0.025, itl_per_seq=0.0005
        )
    )
    scrape_interval: float = 0.05
    kv_event_delay: float = 0.005
    epp_replicas: int = 1
    # Engines announce each admission to every EPP replica (kvgate.api.contracts.admissions),
    # this long after the pick; False models engines that do not (other routers, old engines).
    announce_admissions: bool = True
    admission_delay: float = 0.002
    # With several replicas, ask every other replica for its choice too (see RunResult.agreed).
    # Harmless to the prefix, latency and load plugins, but it advances a round-robin or
    # random picker, so it is off unless asked for.
    measure_agreement: bool = False
    # LoRA: every engine registers these adapters (the bench's --lora-modules) on `max_loras`
    # slots; putting one into a slot costs `sim.lora_load_time`. Empty: LoRA off.
    adapters: tuple[str, ...] = ()
    max_loras: int = 2
    # The host KV tier (sim.cpu_kv_blocks > 0): when blocks are copied to it (evict | compute)
    kv_offload_on: str = "evict"
    # Flow control in every EPP replica (None: requests are picked as they arrive); replicas
    # tell each other the service they give, `admission_delay` later, as engines announce it.
    flow_control: FlowControlConfig | None = None
    tenant_weights: dict[str, float] = field(default_factory=dict)


@dataclass
class RequestRecord:
    index: int
    group: str
    endpoint: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    scheduled: float | None = None  # start of the step that first ran it (its queue time ends)
    adapter: str | None = None
    tenant: str = ""
    status: int = 200  # 429 / 503: answered by flow control, never sent to an engine
    dispatched: float | None = None  # when flow control let it go (= arrival without it)

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival


@dataclass
class RunResult:
    strategy: str
    rate: float
    records: list[RequestRecord]
    duration: float  # first arrival to last finish, virtual seconds
    pick_seconds: list[float]
    preemptions: int = 0
    lora_loads: int = 0  # adapters put into a slot, all engines (warm-up included)
    # With several EPP replicas: per request, whether every other replica would have picked
    # the engine its own replica picked (asked at the same instant, without acting on it)
    agreed: list[bool] = field(default_factory=list)
    # Output throughput over the steady part of the run: the middle 80% of the tokens produced,
    # over the time they took (a request's tokens spread evenly from its first to its last).
    # First arrival to last finish let one late request move the figure by ~10%.
    steady: bool = True

    def done(self) -> list[RequestRecord]:
        return [r for r in self.records if r.finished is not None]

    def ttft(self, q: float) -> float:
        values = sorted(r.ttft for r in self.done())
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    @property
    def output_tok_s(self) -> float:
        done = self.done()
        if not self.steady:
            return sum(r.output_tokens for r in done) / self.duration if self.duration > 0 else 0.0
        times: list[float] = []
        for r in done:
            assert r.first_token is not None and r.finished is not None
            n = r.output_tokens
            step = (r.finished - r.first_token) / max(1, n - 1)
            times += [r.first_token + i * step for i in range(n)]
        if len(times) < 10:
            return sum(r.output_tokens for r in done) / self.duration if self.duration > 0 else 0.0
        times.sort()
        lo, hi = len(times) // 10, len(times) - 1 - len(times) // 10
        return (hi - lo) / (times[hi] - times[lo]) if times[hi] > times[lo] else 0.0

    @property
    def hit_rate(self) -> float:
        done = self.done()
        total = sum(r.prompt_tokens for r in done)
        return sum(r.cached_tokens for r in done) / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "rate": self.rate,
            "requests": len(self.done()),
            "ttft_p50": self.ttft(0.5),
            "ttft_p90": self.ttft(0.9),
            "output_tok_s": self.output_tok_s,
            "prefix_hit": self.hit_rate,
            "pick_ms_p50": 1000 * statistics.median(self.pick_seconds) if self.pick_seconds else 0.0,
            "pick_ms_p99": 1000 * _quantile(self.pick_seconds, 0.99),
            "preemptions": self.preemptions,
            "lora_loads": self.lora_loads,
            "agreement": sum(self.agreed) / len(self.agreed) if self.agreed else float("nan"),
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class _Engine:
    def __init__(self, address: str, pool: PoolSpec, tokenizer: Any) -> None:
        self.address = address
        self.last_step = 0.0
        # The step running on the virtual clock: its end, and the prompt tokens it computes. A
        # real engine's metrics, read mid-step, count those as prefill still ahead.
        self.step_end = 0.0
        self.step_prefill_tokens = 0
        config = EngineConfig(
            model=MODEL,
            simulate=True,
            block_size=pool.block_size,
            num_kv_blocks=pool.kv_blocks,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            scheduling_policy=pool.scheduling_policy,
            long_prefill_token_threshold=pool.long_prefill_token_threshold,
            # no larger than the pool holds, so the engine does not warn that it caps it
            max_model_len=min(8192, pool.kv_blocks * pool.block_size),
            simulation=pool.sim,
            enable_lora=bool(pool.adapters),
            max_loras=pool.max_loras,
            kv_offload_on=pool.kv_offload_on,
        )
        config.simulation.num_kv_blocks = pool.kv_blocks
        runner = SimulatedRunner(config, tokenizer, eos_token_id=None, sleep=self._sleep)
        self.engine = LLMEngine(config, runner=runner, tokenizer=tokenizer)
        for name in pool.adapters:
            self.engine.add_lora(name, self.engine.load_lora(name, f"/adapters/{name}"))
        self.busy = False

    def _sleep(self, seconds: float) -> None:
        self.last_step = seconds
        self.step_prefill_tokens = self.engine.scheduler.in_flight_prefill_tokens

    def in_flight_prefill_tokens(self, now: float) -> int:
        """Prompt tokens of the step still running on the virtual clock at `now`."""
        return self.step_prefill_tokens if now < self.step_end else 0


class VirtualPool:
    """One run: a fresh pool of engines and EPP replicas on a virtual clock."""

    def __init__(self, pool: PoolSpec, strategy: str, config_yaml: dict[str, Any] | None = None) -> None:
        from kvgate.api.tokenizer import load_tokenizer

        self.pool = pool
        self.strategy = strategy
        self.now = START
        tokenizer = load_tokenizer("default")
        self.engines = {
            f"10.0.0.{i + 1}:8000": _Engine(f"10.0.0.{i + 1}:8000", pool, tokenizer)
            for i in range(pool.engines)
        }
        endpoints = [Endpoint(a, kv_events=f"tcp://{a}") for a in self.engines]
        self._partition: dict[str, str] | None = {} if strategy == ORACLE else None
        if self._partition is not None:
            strategy = "round-robin"  # the replicas still scrape and index; the oracle picks
        self.replicas: list[tuple[Datastore, Director]] = []
        self.flows: list[FlowController] = []
        for _ in range(pool.epp_replicas):
            cfg = load_config(None, strategy) if config_yaml is None else _parse(config_yaml)
            store = Datastore()
            store.set_endpoints(endpoints)
            for state in store.all():
                state.kv_events_live = True
                state.served_models = frozenset({MODEL, *pool.adapters})
                state.served_adapters = frozenset(pool.adapters)
            profile = build_profiles(cfg)[0]
            director = Director(store, profile, saturation_detector(cfg), clock=self._clock)
            self.replicas.append((store, director))
            if pool.flow_control is not None:
                self.flows.append(FlowController(director, pool.flow_control, _Weights(pool.tenant_weights)))
        for i, flow in enumerate(self.flows):
            flow.on_charge = lambda tenant, tokens, i=i: self._share_service(i, tenant, tokens)
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.records: dict[str, RequestRecord] = {}
        self._round = -1  # how many times run() was called before: request ids stay unique
        self.pick_seconds: list[float] = []
        self.agreed: dict[int, bool] = {}  # request index -> every replica would pick alike
        self._scrape_all()

    def _clock(self) -> float:
        return self.now

    def _at(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def _scrape_all(self) -> None:
        for address, eng in self.engines.items():
            stats = eng.engine.get_stats()
            for store, _ in self.replicas:
                store.update_metrics(
                    address,
                    EndpointMetrics(
                        waiting=stats.num_waiting,
                        running=stats.num_running,
                        kv_usage=stats.kv_cache_usage,
                        max_lora=self.pool.max_loras if self.pool.adapters else 0,
                        running_loras=frozenset(stats.running_loras),
                        waiting_loras=frozenset(stats.waiting_loras),
                        prefill_tokens_pending=stats.prefill_tokens_pending
                        + eng.in_flight_prefill_tokens(self.now),
                        kv_blocks_total=stats.num_kv_blocks,
                        prompt_tokens_total=stats.prompt_tokens_total,
                        prefix_hits_total=stats.prefix_cache_hits_total,
                        external_hits_total=stats.host_cache_hits_total,
                        host_kv_blocks_total=stats.num_host_kv_blocks or None,
                        kv_copy_seconds_total=stats.host_kv_copy_seconds_total,
                        kv_blocks_copied_total=stats.host_kv_stores_total + stats.host_kv_loads_total,
                        updated_at=self.now,
                        sent_at=self.now,
                    ),
                )

    def _share_service(self, replica: int, tenant: str, tokens: float) -> None:
        for j, other in enumerate(self.flows):
            if j != replica:
                self._at(self.now + self.pool.admission_delay, "service", (other, tenant, tokens))

    def _dispatch_held(self) -> None:
        for flow in self.flows:
            if flow.queued:
                flow.dispatch()

    def _arrive(self, req: BenchRequest, tokens: list[int]) -> None:
        replica = req.index % len(self.replicas)
        _, director = self.replicas[replica]
        text = " ".join(req.nominal_words)
        model = req.model or MODEL
        if req.tenant is None and self.pool.tenants:
            req = dataclasses.replace(req, tenant=f"tenant-{req.index % self.pool.tenants}")
        body = {"model": model, "prompt": text, "max_tokens": req.max_tokens}
        request = InferenceRequest(
            request_id=f"r{req.index}" if not self._round else f"r{req.index}.{self._round}",
            model=model,
            target_model=model,
            body=body,
            priority=req.priority,
            fairness_id=req.tenant,
            _token_ids=tokens,
            _prompt_text=text,
        )
        # The engine is filled in when it reaches one (_admit); a request answered without one
        # (shed, or refused by flow control) keeps its status and never reaches an engine.
        record = self.records[request.request_id] = RequestRecord(
            req.index,
            req.group,
            "",
            self.now,
            len(tokens),
            req.max_tokens,
            adapter=req.model,
            tenant=req.tenant or "",
        )
        if self.flows:

            def done(held: Held) -> None:
                decision = held.decision
                assert decision is not None
                self.pick_seconds.append(decision.scheduler_seconds)
                if decision.routed:
                    self._admit(req, tokens, request, decision.targets[0])
                else:
                    self._answered(record, request.request_id, decision.status)

            self.flows[replica].submit(request, on_done=done)
            return
        others = (
            [self._would_pick(d, request) for _, d in self.replicas if d is not director]
            if self.pool.measure_agreement and self._partition is None
            else []
        )
        if self._partition is not None:
            address = self._oracle_pick(req.group)
        else:
            decision = director.pick(request)
            self.pick_seconds.append(decision.scheduler_seconds)
            if not decision.routed:
                if request.priority >= 0:
                    raise RuntimeError(f"request {req.index} not routed: {decision.reason}")
                self._answered(record, request.request_id, decision.status)  # shed: a 429
                return
            address = decision.targets[0]
        if others:
            self.agreed[req.index] = all(o == address for o in others)
        self._admit(req, tokens, request, address)

    def _answered(self, record: RequestRecord, request_id: str, status: int) -> None:
        """Answered by the EPP itself (429/503), never sent to an engine."""
        record.status = status
        self._finished(request_id, self.now)

    def _admit(self, req: BenchRequest, tokens: list[int], request: InferenceRequest, address: str) -> None:
        """The request reaches its engine (and the other replicas hear of the pick)."""
        record = self.records[request.request_id]
        record.endpoint = address
        record.dispatched = self.now
        if self.pool.announce_admissions:
            picker = self.replicas[req.index % len(self.replicas)][0]
            admission = Admission(picker.replica_id, tokens)
            # to every replica, as engines publish it: the picker's own pick is then confirmed
            for store, _ in self.replicas:
                self._at(self.now + self.pool.admission_delay, "admitted", (store, address, admission))
        eng = self.engines[address]
        eng.engine.add_request(
            request.request_id,
            tokens,
            SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0),
            arrival_time=self.now,
            lora_id=None if req.model is None else lora_int_id(req.model),
            # as the EPP forwards them (GIE's priority: higher first; the engine's: lower first)
            priority=-req.priority,
            tenant=req.tenant or "",
            over_share=request.over_share,
        )
        if not eng.busy:
            eng.busy = True
            self._at(self.now, "step", address)

    def _oracle_pick(self, group: str) -> str:
        assert self._partition is not None
        found = self._partition.get(group)
        if found is None:
            addresses = list(self.engines)
            found = self._partition[group] = addresses[len(self._partition) % len(addresses)]
        return found

    def _would_pick(self, director: Director, request: InferenceRequest) -> str | None:
        """The endpoint another replica would pick for this request now, asked without acting
        on it (no pick recorded there: the replica whose pick it is records it, as in
        production, where each request meets one replica). The prefix and load plugins only
        expire their own old entries when asked; a latency model folds in the scrapes it is
        shown, and more of them teach it otherwise, so its state is put back afterwards."""
        models = [
            (plugin, copy.deepcopy(plugin.model))
            for plugin in director.profile.plugins()
            if isinstance(plugin, PredictedLatencyScorer)
        ]
        # the request itself: scheduling only reads it (its tokens and text come filled in)
        candidates = director.candidates(request)
        result = director.profile.run(SchedulingContext(request, director.datastore, self.now), candidates)
        for plugin, model in models:
            plugin.model = model
        return result.targets[0].address if result.targets else None

    def _step(self, address: str) -> None:
        eng = self.engines[address]
        if not eng.engine.has_unfinished_requests():
            eng.busy = False
            return
        eng.last_step = 0.0
        outputs = eng.engine.step()
        for request in eng.engine.scheduler.running:
            rec = self.records.get(request.request_id)
            if rec is not None and rec.scheduled is None:
                rec.scheduled = self.now
        end = self.now + eng.last_step
        eng.step_end = end
        for out in outputs:
            rec = self.records[out.request_id]
            if rec.first_token is None and out.token_ids:
                rec.first_token = end
                rec.cached_tokens = out.num_cached_tokens
            if out.finished:
                rec.finished = end
                self._finished(out.request_id, end)
        events = eng.engine.drain_kv_events()
        if events:
            self._at(self.now + self.pool.kv_event_delay, "kv", (address, events))
        self._at(end if end > self.now else self.now + 1e-4, "step", address)
        self._dispatch_held()

    def _finished(self, request_id: str, when: float) -> None:
        for dependent in self._waiting_on.pop(self.records[request_id].index, []):
            self._at(when, "arrive", dependent)

    def run(self, requests: Iterable[tuple[float, BenchRequest, list[int]]]) -> RunResult:
        """Serve the requests (arrival offsets from now) until every one has finished. Called
        again, the same pool serves more: caches, indexes and learnt speeds carry over, as when
        a process bench sweeps its rates on one stack."""
        self._waiting_on: dict[int, list[tuple[BenchRequest, list[int]]]] = {}
        base = self.now
        self._round += 1
        earlier = set(self.records)
        first = None
        for when, req, tokens in requests:
            first = when if first is None else first
            if req.depends_on is not None:
                self._waiting_on.setdefault(req.depends_on, []).append((req, tokens))
            else:
                self._at(base + when, "arrive", (req, tokens))
        self._at(base + self.pool.scrape_interval, "scrape")
        while self._events:
            when, _, kind, payload = heapq.heappop(self._events)
            self.now = when
            if kind == "arrive":
                self._arrive(*payload)
            elif kind == "step":
                self._step(payload)
            elif kind == "kv":
                address, events = payload
                for store, _ in self.replicas:
                    store.index.apply(address, events)
            elif kind == "admitted":
                store, address, admission = payload
                store.note_admission(address, admission, self.now)
            elif kind == "service":
                flow, tenant, tokens = payload
                flow.note_remote_service(tenant, tokens)
            elif kind == "scrape":
                self._scrape_all()
                self._dispatch_held()
                held = any(f.queued for f in self.flows)
                if self._events or self._waiting_on or held:  # something will still happen
                    self._at(self.now + self.pool.scrape_interval, "scrape")
        records = [r for rid, r in self.records.items() if rid not in earlier]
        last = max((r.finished or 0.0) for r in records) if records else 0.0
        stats = [e.engine.get_stats() for e in self.engines.values()]
        preempted = sum(s.num_preemptions_total for s in stats)
        loads = sum(s.lora_loads_total for s in stats)
        agreed = [self.agreed[r.index] for r in records if r.index in self.agreed]
        return RunResult(
            self.strategy,
            0.0,
            records,
            last - base - (first or 0.0),
            self.pick_seconds,
            preempted,
            loads,
            agreed,
        )


@dataclass
class _Weights:
    weights: dict[str, float]

    def weight(self, name: str) -> float:
        return self.weights.get(name, 1.0)


def _parse(raw: dict[str, Any]) -> Any:
    from kvgate.epp.scheduling.config import parse_config

    return parse_config(raw, source="virtual pool")


def poisson_requests(
    spec: WorkloadSpec, rate: float, count: int, seed: int = 0
) -> list[tuple[float, BenchRequest, list[int]]]:
    """`count` requests of the workload with Poisson arrivals at `rate` per second."""
    rng = random.Random(f"{seed}:arrivals")
    out = []
    t = 0.0
    for req in itertools.islice(generate(spec), count):
        t += rng.expovariate(rate)
        out.append((t, req, [word_token(w) for w in req.nominal_words]))
    return out


def simulate(
    strategy: str,
    spec: WorkloadSpec,
    rate: float,
    count: int,
    warmup: int = 0,
    pool: PoolSpec | None = None,
    config: dict[str, Any] | None = None,
) -> RunResult:
    """One strategy at one rate; the first `warmup` requests are sent but not counted."""
    vp = VirtualPool(pool or PoolSpec(), strategy, config)
    result = vp.run(poisson_requests(spec, rate, warmup + count, seed=spec.seed))
    counted = [r for r in result.records if r.index >= warmup]
    return _measured(vp, strategy, rate, counted, result.pick_seconds[warmup:], result)


def simulate_sweep(
    strategy: str,
    spec: WorkloadSpec,
    rates: list[float],
    count: int,
    warmup: int = 0,
    pool: PoolSpec | None = None,
    config: dict[str, Any] | None = None,
) -> list[RunResult]:
    """Every rate on one pool, in turn, as `kvgate bench` sweeps on one stack: at each rate the
    same requests again, the warm-up ones served to the end before the counted ones start, and
    what the caches and the EPP learnt at one rate still there at the next."""
    vp = VirtualPool(pool or PoolSpec(), strategy, config)
    out = []
    for rate in rates:
        stream = poisson_requests(spec, rate, warmup + count, seed=spec.seed)
        if warmup:
            vp.run(stream[:warmup])
        shift = stream[warmup - 1][0] if warmup else 0.0
        picks = len(vp.pick_seconds)
        result = vp.run([(when - shift, req, tokens) for when, req, tokens in stream[warmup:]])
        out.append(_measured(vp, strategy, rate, result.records, vp.pick_seconds[picks:], result))
    return out


def _measured(
    vp: VirtualPool,
    strategy: str,
    rate: float,
    counted: list[RequestRecord],
    pick_seconds: list[float],
    result: RunResult,
) -> RunResult:
    start = min((r.arrival for r in counted), default=0.0)
    end = max((r.finished or 0.0 for r in counted), default=0.0)
    return RunResult(
        strategy,
        rate,
        counted,
        end - start,
        pick_seconds,
        result.preemptions,
        result.lora_loads,
        [vp.agreed[r.index] for r in counted if r.index in vp.agreed],
    )

"""The virtual-clock routing simulator: deterministic, the real EPP and engine scheduler inside,
and the named bench presets."""

from __future__ import annotations

import argparse
from collections import Counter

from kvgate.bench.presets import PRESETS, apply_preset
from kvgate.bench.virtual_pool import ORACLE, PoolSpec, simulate, simulate_sweep
from kvgate.bench.workloads import MultiTurnSpec, SharedPrefixSpec, WorkloadSpec
from kvgate.engine.config import SimulationConfig

SMALL = PoolSpec(
    engines=4,
    kv_blocks=160,
    sim=SimulationConfig(prefill_time_per_token=0.0004, itl_base=0.025, itl_per_seq=0.0005),
)
SHARED = WorkloadSpec(
    shared_prefix=SharedPrefixSpec(groups=8, prefix_tokens=512, suffix_tokens=16, output_tokens=8)
)


def test_a_run_is_deterministic_and_prefix_routing_beats_round_robin() -> None:
    one = simulate("precise-prefix", SHARED, rate=8.0, count=80, warmup=16, pool=SMALL)
    two = simulate("precise-prefix", SHARED, rate=8.0, count=80, warmup=16, pool=SMALL)
    assert [r.ttft for r in one.done()] == [r.ttft for r in two.done()]
    assert len(one.done()) == 80
    rr = simulate("round-robin", SHARED, rate=8.0, count=80, warmup=16, pool=SMALL)
    # 8 groups of 32 blocks over 4 pools of 160: precise routing keeps each group where it is
    assert one.hit_rate > 0.9 > rr.hit_rate
    assert one.ttft(0.9) < rr.ttft(0.9)


def test_the_oracle_keeps_each_group_on_one_engine_and_deals_them_evenly() -> None:
    result = simulate(ORACLE, SHARED, rate=8.0, count=80, warmup=16, pool=SMALL)
    assert len(result.done()) == 80
    homes: dict[str, set[str]] = {}
    for r in result.records:
        homes.setdefault(r.group, set()).add(r.endpoint)
    assert all(len(engines) == 1 for engines in homes.values())
    per_engine = Counter(next(iter(engines)) for engines in homes.values())
    assert len(per_engine) == SMALL.engines and max(per_engine.values()) - min(per_engine.values()) <= 1
    # a reference, not a router: it takes no pick time and nothing asks it to agree
    assert result.pick_seconds == [] and result.agreed == []
    # 8 groups of 32 blocks, 2 per pool of 160: every group is computed once and then hit
    assert result.hit_rate > 0.9


def test_a_sweep_on_one_pool_carries_its_caches_from_rate_to_rate() -> None:
    first, second = simulate_sweep("precise-prefix", SHARED, [4.0, 8.0], count=40, warmup=8, pool=SMALL)
    fresh = simulate("precise-prefix", SHARED, rate=8.0, count=40, warmup=8, pool=SMALL)
    assert (first.rate, second.rate) == (4.0, 8.0)
    assert len(first.done()) == len(second.done()) == 40
    assert len(first.pick_seconds) == len(second.pick_seconds) == 40
    # the same requests again: every prompt's prefix was computed at the first rate
    assert second.hit_rate > fresh.hit_rate
    assert all(r.cached_tokens >= 512 - 16 for r in second.done())
    assert 0 < second.duration < first.duration  # measured from its own first arrival


def test_every_strategy_runs_with_two_epp_replicas() -> None:
    pool = PoolSpec(**{**SMALL.__dict__, "epp_replicas": 2})
    for strategy in ("precise-prefix", "precise-prefix-weights", "default", "round-robin"):
        result = simulate(strategy, SHARED, rate=8.0, count=40, warmup=8, pool=pool)
        assert len(result.done()) == 40, strategy
        assert len({r.endpoint for r in result.done()}) > 1, strategy


def test_asking_the_other_replica_changes_no_pick_and_measures_agreement() -> None:
    pool = PoolSpec(**{**SMALL.__dict__, "epp_replicas": 2})
    asked = PoolSpec(**{**pool.__dict__, "measure_agreement": True})
    plain = simulate("precise-prefix", SHARED, rate=8.0, count=60, warmup=8, pool=pool)
    probed = simulate("precise-prefix", SHARED, rate=8.0, count=60, warmup=8, pool=asked)
    # the question is side-effect free: every request goes where it went without it
    assert [(r.index, r.endpoint) for r in plain.records] == [(r.index, r.endpoint) for r in probed.records]
    assert not plain.agreed and len(probed.agreed) == 60
    # KV events and admission announcements are shared: precise-prefix replicas agree
    assert probed.summary()["agreement"] >= 0.95


def test_multi_turn_sends_a_turn_only_after_the_previous_one_answered() -> None:
    spec = WorkloadSpec(
        kind="multi-turn",
        multi_turn=MultiTurnSpec(
            conversations=4, turns=3, first_turn_tokens=64, user_turn_tokens=16, output_tokens=8
        ),
    )
    result = simulate("precise-prefix", spec, rate=20.0, count=24, pool=SMALL)
    by_index = {r.index: r for r in result.records}
    from itertools import islice

    from kvgate.bench.workloads import generate

    for req in islice(generate(spec), 24):
        if req.depends_on is not None and req.index in by_index and req.depends_on in by_index:
            before = by_index[req.depends_on]
            assert before.finished is not None and by_index[req.index].arrival >= before.finished


def test_a_preset_fills_only_the_flags_left_at_their_defaults() -> None:
    defaults = {
        "groups": 16,
        "prefix_tokens": 2048,
        "request_rate": "8",
        "engines": None,
        "workload": "shared-prefix",
    }
    args = argparse.Namespace(
        groups=16,
        prefix_tokens=4096,  # given explicitly: kept
        suffix_tokens=32,
        output_tokens=32,
        request_rate="8",
        engines=None,
        sim_kv_blocks=320,
        num_requests=320,
        warmup_requests=None,
        workload="shared-prefix",
    )
    defaults |= {
        "suffix_tokens": 32,
        "output_tokens": 32,
        "sim_kv_blocks": 320,
        "num_requests": 320,
        "warmup_requests": None,
    }
    applied = apply_preset(args, "llm-d-shared-prefix", defaults)
    assert args.groups == 64 and args.prefix_tokens == 4096 and args.engines == 16
    assert args.request_rate == "4,8,16,24" and "--prefix-tokens 6000" not in applied
    assert set(PRESETS) == {
        "batch-and-online",
        "llm-d-shared-prefix",
        "llm-d-tiered",
        "multi-turn-chat",
        "pd-long-prompt",
        "lora",
        "noisy-neighbor",
    }


def test_lora_adapters_cost_slot_loads_that_affinity_routing_avoids() -> None:
    from kvgate.bench.workloads import LoRASpec

    spec = WorkloadSpec(
        kind="lora", lora=LoRASpec(adapters=6, prefix_tokens=64, suffix_tokens=16, output_tokens=8)
    )
    pool = PoolSpec(
        **{
            **SMALL.__dict__,
            "adapters": tuple(LoRASpec(adapters=6).names()),
            "max_loras": 2,
            "sim": SimulationConfig(prefill_time_per_token=0.0004, itl_base=0.025, lora_load_time=0.05),
        }
    )
    aware = simulate("precise-prefix", spec, rate=8.0, count=60, warmup=8, pool=pool)
    rr = simulate("round-robin", spec, rate=8.0, count=60, warmup=8, pool=pool)
    assert len(aware.done()) == len(rr.done()) == 60
    assert {r.adapter for r in aware.done()} > {None}  # adapter requests ran (and base ones)
    # 6 adapters on 8 slots: affinity keeps each where it is loaded, round-robin reloads
    assert rr.lora_loads > 3 * aware.lora_loads > 0
    assert aware.ttft(0.9) < rr.ttft(0.9)


def test_a_flag_given_at_its_default_value_still_beats_the_preset() -> None:
    from kvgate.bench.presets import EXPLICIT_DEST
    from kvgate.cli import build_parser

    parser = build_parser(["bench"], only_selected=True)
    args = parser.parse_args(["bench", "--preset", "lora", "--max-loras", "2", "--request-rate", "8"])
    explicit = frozenset(getattr(args, EXPLICIT_DEST))
    applied = apply_preset(args, "lora", args.flag_defaults, explicit)
    # 2 and "8" are the parser's defaults, and the preset's are 1 and "4,8": the user's win
    assert (args.max_loras, args.request_rate) == (2, "8")
    assert "--adapters 12" in applied and not any(
        a.startswith(("--max-loras", "--request-rate")) for a in applied
    )
    untouched = parser.parse_args(["bench", "--preset", "lora"])
    apply_preset(
        untouched, "lora", untouched.flag_defaults, frozenset(getattr(untouched, EXPLICIT_DEST, None) or ())
    )
    assert (untouched.max_loras, untouched.request_rate) == (1, "4,8")


def test_one_system_prompt_shared_by_every_conversation_does_not_pile_onto_its_holder() -> None:
    # Every conversation opens with the same system prompt (the multi-turn-chat preset's shape
    # with one prompt): cached on one engine after the first turn, it made that engine the
    # predicted-fastest for every new conversation until the histories overflowed its KV and
    # it thrashed while seven engines idled (all 200 requests there, TTFT p90 7.0 s).
    spec = WorkloadSpec(
        kind="multi-turn",
        multi_turn=MultiTurnSpec(
            conversations=32,
            turns=8,
            first_turn_tokens=2000,
            user_turn_tokens=200,
            output_tokens=200,
            system_prompts=1,
        ),
    )
    pool = PoolSpec(engines=8, kv_blocks=2048, sim=SMALL.sim)
    result = simulate("precise-prefix", spec, rate=8.0, count=200, warmup=16, pool=pool)
    per_engine = Counter(r.endpoint for r in result.done())
    assert len(result.done()) == 200
    assert max(per_engine.values()) <= 0.5 * 200, per_engine
    assert result.ttft(0.9) < 1.0


def test_a_host_kv_tier_turns_recomputes_into_loads_and_routing_sees_it() -> None:
    """16 groups of 32 blocks over 4 device pools of 96 blocks (3 groups each): without a tier
    groups evict each other and are computed again; with a host tier of 4x the pool they come
    back by copy, every strategy gets the same tiered engines, and precise routing stays on
    the holders (both tiers count) rather than scattering."""
    spec = WorkloadSpec(
        shared_prefix=SharedPrefixSpec(groups=16, prefix_tokens=512, suffix_tokens=16, output_tokens=8)
    )
    small = PoolSpec(engines=4, kv_blocks=96, sim=SMALL.sim)
    tiered = PoolSpec(
        engines=4,
        kv_blocks=96,
        sim=SimulationConfig(
            prefill_time_per_token=0.0004, itl_base=0.025, itl_per_seq=0.0005, cpu_kv_blocks=384
        ),
    )
    plain = simulate("precise-prefix", spec, rate=8.0, count=96, warmup=32, pool=small)
    with_tier = simulate("precise-prefix", spec, rate=8.0, count=96, warmup=32, pool=tiered)
    assert with_tier.hit_rate > plain.hit_rate
    assert with_tier.hit_rate > 0.9
    oracle = simulate(ORACLE, spec, rate=8.0, count=96, warmup=32, pool=tiered)
    assert oracle.hit_rate > 0.9
    rr = simulate("round-robin", spec, rate=8.0, count=96, warmup=32, pool=tiered)
    assert with_tier.ttft(0.9) < rr.ttft(0.9)


def test_output_throughput_is_the_steady_middle_of_the_run() -> None:
    """One straggler finishing long after the rest moves first-arrival-to-last-finish a lot and
    the steady figure (the middle 80% of tokens over the time they took) not at all."""
    from kvgate.bench.virtual_pool import RequestRecord, RunResult

    def run(straggler_end: float) -> RunResult:
        records = [RequestRecord(i, "g", "e", i * 0.1, 10, 10, first_token=i * 0.1 + 0.1, finished=i * 0.1 + 1.0)
                   for i in range(100)]  # fmt: skip
        records.append(RequestRecord(100, "g", "e", 10.0, 10, 10, first_token=10.1, finished=straggler_end))
        duration = max(r.finished or 0.0 for r in records)
        return RunResult("s", 1.0, records, duration, [])

    on_time, late = run(11.0), run(30.0)
    assert (
        late.output_tok_s == on_time.output_tok_s or abs(late.output_tok_s / on_time.output_tok_s - 1) < 0.02
    )
    whole = [RunResult(r.strategy, 1.0, r.records, r.duration, [], steady=False) for r in (on_time, late)]
    assert whole[1].output_tok_s < 0.5 * whole[0].output_tok_s


def test_the_tiered_preset_gives_the_engines_a_host_tier() -> None:
    values = PRESETS["llm-d-tiered"].values
    assert values["sim_cpu_kv_blocks"] == 4 * int(values["sim_kv_blocks"])  # type: ignore[call-overload]


def test_the_default_engines_and_flow_control_shield_a_light_tenant_and_lose_nothing() -> None:
    """The virtual pool with the real flow controller: a tenant flooding long prompts past the
    pool's capacity and a light tenant of short ones. Engines that serve in arrival order keep
    the light tenant's requests behind the flood's queued prompts (pool dispatch holds nothing
    for it while the pool is not saturated, then everything while it is); the default engines
    (fair waiting order, long prompts capped while short ones arrive) run them next, with or
    without flow control. Every request ends served or answered."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import noisy_neighbor as nn

    from kvgate.epp.flow_control import FlowControlConfig

    stream = nn._requests([nn.Tenant("A", 4000, 3.0), nn.Tenant("B", 256, 1.0)], 6.0, seed=0)
    arrival_order = argparse.Namespace(
        engines=2, kv_blocks=1800, scheduling_policy="fcfs", long_prefill_token_threshold=0
    )
    defaults = argparse.Namespace(engines=2, kv_blocks=1800)
    flow = FlowControlConfig(ttl_s=3.0)
    runs = {
        "fcfs": nn._run(nn._pool(arrival_order, None), stream),
        "fcfs, flow control": nn._run(nn._pool(arrival_order, flow), stream),
        "default": nn._run(nn._pool(defaults, None), stream),
        "default, flow control": nn._run(nn._pool(defaults, flow), stream),
    }
    p90 = {name: nn._ttft_p90(run, "B") for name, run in runs.items()}
    # measured: 6.4 s and 13.8 s in arrival order, 0.89 s both ways with the defaults
    assert p90["default"] < 0.25 * p90["fcfs"] and p90["default, flow control"] < 0.25 * p90["fcfs"]
    assert p90["fcfs, flow control"] > p90["default, flow control"]
    for run in runs.values():
        assert all(r.finished is not None or r.status in (429, 503) for r in run.records)
        assert {r.status for r in run.records if r.tenant == "B"} == {200}


def test_a_scrape_mid_step_counts_the_prompt_tokens_that_step_computes() -> None:
    """A real engine's metrics, read while a step runs, still count that step's prompt tokens
    as ahead of a new request. The virtual engine runs a step at once and finishes it on the
    virtual clock later; its scrapes must read the same, or an engine computing the last chunk
    of a long prompt looks idle for the whole step (flow control then sent short requests
    there, to wait out the step)."""
    from kvgate.bench.virtual_pool import VirtualPool, word_token
    from kvgate.bench.workloads import BenchRequest

    seen: list[tuple[float, int | None]] = []

    class Probe(VirtualPool):
        def _scrape_all(self) -> None:
            super()._scrape_all()
            seen.extend(
                (self.now, state.metrics.prefill_tokens_pending) for state in self.replicas[0][0].all()
            )

    words = tuple(f"long{i}" for i in range(4000))
    req = BenchRequest(index=0, messages=(), max_tokens=4, group="g", nominal_words=words)
    pool = Probe(PoolSpec(engines=1, kv_blocks=1800, sim=SMALL.sim), "round-robin")
    result = pool.run([(0.0, req, [word_token(w) for w in words])])
    (record,) = result.records
    assert record.first_token is not None and record.first_token > 1.5  # two 2,048-token steps
    assert record.scheduled is not None
    during = [pending for when, pending in seen if record.scheduled < when < record.first_token]
    assert len(during) > 20 and all(pending for pending in during), during
    after = {pending for when, pending in seen if when > record.first_token}
    assert after == {0}

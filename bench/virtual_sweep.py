"""Routing strategies swept over request rates on the virtual-clock pool (seconds, not minutes).

    .venv/bin/python bench/virtual_sweep.py [--preset llm-d-shared-prefix] [--strategies a,b,c]
        [--rates 4,8,16,24] [--seeds 0,1] [--epp-replicas 1] [--sim-kv-blocks N] [--carry-over]

The real EPP (profiles, datastore, precise index) in front of real engine schedulers and KV
cache managers with the simulated runner's timing, on a virtual clock (kvgate.bench.
virtual_pool). Deterministic for a seed (str hashing is fixed with PYTHONHASHSEED=0 unless you
set it); several seeds are averaged. What it leaves out
(processes, HTTP, Envoy, a loaded CPU) the process bench has: `kvgate bench --compare
--simulate --preset ...` confirms what this finds.

Prints, per rate and strategy, TTFT p50/p90 (s), output tok/s (over the window from the first
counted arrival to the last: the pool under the offered load, not the drain after it), prefix
hit rate (device and host tier) beside the best any router can reach on the requests counted
(`ideal`: given what was sent before them, the warm-up and, with --carry-over, the earlier
rates, which resend the same requests), and the in-process pick time (the scheduler alone, ms
p50/p99: the cost target is 0.25 ms at 16 endpoints), then the candidate (--candidate, default
the first strategy) as a multiple of every other strategy at the same rate.

`oracle-partition` is a reference, not a router (kvgate.bench.virtual_pool.ORACLE): it deals
each group of the workload to one engine for the whole run, knowing the groups in advance, so
its row is what placement alone can reach on this pool. With `--sim-kv-blocks` raised past what
the groups need (e.g. 8000 on the llm-d preset), it shows what the same pool would serve if KV
capacity did not bound each engine's batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvgate.bench.cli import workload_spec
from kvgate.bench.presets import PRESETS
from kvgate.bench.stats import ideal_prefix_hit_rate
from kvgate.bench.virtual_pool import PoolSpec, poisson_requests, simulate, simulate_sweep
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.waiting_queue import POLICIES
from kvgate.epp.flow_control import FlowControlConfig

METRICS = (
    "ttft_p50",
    "ttft_p90",
    "output_tok_s",
    "prefix_hit",
    "lora_loads",
    "pick_ms_p50",
    "pick_ms_p99",
    "agreement",
)


def bench_args(preset: str, seed: int) -> argparse.Namespace:
    """`kvgate bench --preset PRESET --seed SEED` as that command reads it: the same workload,
    pool and request counts as the process bench."""
    from kvgate.bench.cli import resolve_preset
    from kvgate.cli import build_parser

    args = build_parser(["bench"], only_selected=True).parse_args(
        ["bench", "--preset", preset, "--seed", str(seed)]
    )
    resolve_preset(args)
    return args


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") is None:
        # GIE's approximate prefix scorer hashes prompt text with hash(), salted per process:
        # one fixed salt makes every run of a seed pick alike.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"})
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # noisy-neighbor is a multi-tenant experiment of its own (bench/noisy_neighbor.py here); the
    # virtual pool has no prefill/decode split, so presets that need one run in `kvgate bench`
    ap.add_argument(
        "--preset",
        choices=sorted(
            p for p, preset in PRESETS.items() if p != "noisy-neighbor" and "pd" not in preset.values
        ),
        default="llm-d-shared-prefix",
    )
    ap.add_argument("--strategies", default="precise-prefix,precise-prefix-weights,default,round-robin")
    ap.add_argument(
        "--candidate", default=None, help="the strategy the ratios are about (default: the first)"
    )
    ap.add_argument("--rates", default=None, help="req/s, comma-separated (default: the preset's)")
    ap.add_argument("--seeds", default="0", help="comma-separated; results are averaged over them")
    ap.add_argument("--epp-replicas", type=int, default=1)
    ap.add_argument(
        "--carry-over",
        action="store_true",
        help="serve every rate on one pool, in turn, as `kvgate bench` does on one stack (caches and "
        "what the EPP learnt carry over; each rate sends the same requests again); default: a "
        "fresh pool per rate",
    )
    ap.add_argument(
        "--sim-kv-blocks", type=int, default=None, help="KV blocks per engine (default: the preset's)"
    )
    ap.add_argument(
        "--sim-cpu-kv-blocks",
        type=int,
        default=None,
        help="a host KV tier of this many blocks per engine (default: the preset's, or none)",
    )
    ap.add_argument(
        "--sim-kv-offload-bandwidth",
        type=float,
        default=None,
        help="bytes per second between an engine's host tier and its device (default: the engine's)",
    )
    ap.add_argument(
        "--kv-offload-on",
        choices=["evict", "compute"],
        default="evict",
        help="when an engine copies a block to its host tier",
    )
    ap.add_argument(
        "--no-admissions",
        action="store_true",
        help="engines do not announce admissions: each EPP replica sees only its own picks",
    )
    ap.add_argument(
        "--agreement",
        action="store_true",
        help="with --epp-replicas 2 or more: per request, ask the other replicas which engine they "
        "would pick at that instant (without acting on it) and print how often all agree; asking "
        "advances a round-robin or random picker, so those strategies route differently with it",
    )
    ap.add_argument(
        "--flow-control",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the EPP's flow control (on by default in `kvgate epp serve`) at its default settings: "
        "requests held while no engine has room, picked then among those that have",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="deal the requests round-robin to this many tenants (fairness ids; the engines' tenants too)",
    )
    ap.add_argument("--scheduling-policy", choices=POLICIES, default=EngineConfig.scheduling_policy)
    ap.add_argument(
        "--long-prefill-token-threshold", type=int, default=EngineConfig.long_prefill_token_threshold
    )
    args = ap.parse_args()

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    candidate = args.candidate or strategies[0]
    bench = {seed: bench_args(args.preset, seed) for seed in [int(s) for s in args.seeds.split(",")]}
    seeds = list(bench)
    first = bench[seeds[0]]
    rates = [float(r) for r in (args.rates or first.request_rate).split(",")]
    pool = PoolSpec(
        engines=first.engines,
        kv_blocks=args.sim_kv_blocks or first.sim_kv_blocks,
        sim=SimulationConfig(
            prefill_time_per_token=first.sim_prefill_time_per_token,
            itl_base=first.sim_itl,
            itl_per_seq=first.sim_itl_per_seq,
            lora_load_time=first.sim_lora_load_time or 0.0,
            cpu_kv_blocks=args.sim_cpu_kv_blocks or first.sim_cpu_kv_blocks,
            **(
                {"kv_offload_bandwidth": args.sim_kv_offload_bandwidth}
                if args.sim_kv_offload_bandwidth
                else {}
            ),
        ),
        kv_offload_on=args.kv_offload_on,
        epp_replicas=args.epp_replicas,
        announce_admissions=not args.no_admissions,
        measure_agreement=args.agreement and args.epp_replicas > 1,
        adapters=tuple(workload_spec(first).lora.names()) if first.workload == "lora" else (),
        max_loras=first.max_loras,
        flow_control=FlowControlConfig() if args.flow_control else None,
        tenants=args.tenants,
        scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    count, warmup = first.num_requests, first.warmup_requests or 0
    print(
        f"preset {args.preset}: {PRESETS[args.preset].summary}; seeds {seeds}; {args.epp_replicas} EPP replica(s)"
        + (f"; {pool.kv_blocks} KV blocks per engine (given)" if args.sim_kv_blocks else "")
        + (
            f"; host KV tier of {pool.sim.cpu_kv_blocks} blocks per engine ({pool.kv_offload_on})"
            if pool.sim.cpu_kv_blocks
            else ""
        )
    )
    results: dict[tuple[float, str], dict[str, float]] = {}
    ideal = {
        rate: statistics.fmean(
            _ideal_hit(bench[seed], rates[: i + 1], count, warmup, pool.block_size, args.carry_over)
            for seed in seeds
        )
        for i, rate in enumerate(rates)
    }
    print(
        f"{'req/s':>5}  {'strategy':18}  {'TTFT p50':>8}  {'TTFT p90':>8}  {'out tok/s':>9}  {'hit/ideal':>12}"
        f"  {'loads':>6}"
        f"  {'pick ms p50/p99':>15}"
    )
    if args.carry_over:
        # every rate on one pool per strategy and seed, as the process bench sweeps
        t0 = time.monotonic()
        swept = {
            (name, seed): simulate_sweep(name, workload_spec(bench[seed]), rates, count, warmup, pool)
            for name in strategies
            for seed in seeds
        }
        per_run = {
            (rate, name): [swept[(name, seed)][i].summary() for seed in seeds]
            for i, rate in enumerate(rates)
            for name in strategies
        }
        elapsed = (time.monotonic() - t0) / max(1, len(per_run))
    for rate in rates:
        for name in strategies:
            t0 = time.monotonic()
            runs = (
                per_run[(rate, name)]
                if args.carry_over
                else [
                    simulate(name, workload_spec(bench[seed]), rate, count, warmup, pool).summary()
                    for seed in seeds
                ]
            )
            took = elapsed if args.carry_over else time.monotonic() - t0
            avg = {k: statistics.fmean(r[k] for r in runs) for k in METRICS}
            results[(rate, name)] = avg
            print(
                f"{rate:5g}  {name:18}  {avg['ttft_p50']:8.2f}  {avg['ttft_p90']:8.2f}  "
                f"{avg['output_tok_s']:9.1f}  {avg['prefix_hit'] * 100:5.1f}%/{ideal[rate] * 100:4.1f}%"
                f"  {avg['lora_loads']:6.1f}"
                f"  {avg['pick_ms_p50']:7.3f}/{avg['pick_ms_p99']:<7.3f}"
                + (f"  agree {avg['agreement'] * 100:5.1f}%" if pool.measure_agreement else "")
                + f"   ({took:.0f} s)",
                flush=True,
            )
    print(f"\n{candidate} as a multiple of each other strategy at the same rate")
    print(f"{'req/s':>5}  {'vs':18}  {'TTFT p50':>8}  {'TTFT p90':>8}  {'out tok/s':>9}")
    for rate in rates:
        mine = results[(rate, candidate)]
        for name in strategies:
            if name == candidate:
                continue
            other = results[(rate, name)]
            print(
                f"{rate:5g}  {name:18}  {mine['ttft_p50'] / other['ttft_p50']:7.2f}×  "
                f"{mine['ttft_p90'] / other['ttft_p90']:7.2f}×  {mine['output_tok_s'] / other['output_tok_s']:8.2f}×"
            )


def _ideal_hit(
    bench: argparse.Namespace, rates: list[float], count: int, warmup: int, block_size: int, carry_over: bool
) -> float:
    """The best hit rate any router reaches on the requests counted at the last of `rates`:
    what was sent before them is history (the warm-up; with carry-over every earlier rate's
    requests too)."""
    spec = workload_spec(bench)
    history: list[list[int]] = []
    for rate in rates[:-1] if carry_over else []:
        history += [tokens for _, _, tokens in poisson_requests(spec, rate, warmup + count, spec.seed)]
    stream = poisson_requests(spec, rates[-1], warmup + count, spec.seed)
    history += [tokens for _, _, tokens in stream[:warmup]]
    counted = [tokens for _, _, tokens in stream[warmup:]]
    return ideal_prefix_hit_rate(counted, block_size, history) or 0.0


if __name__ == "__main__":
    main()

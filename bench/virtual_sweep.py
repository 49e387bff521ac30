"""Routing strategies swept over request rates on the virtual-clock pool (seconds, not minutes).

    .venv/bin/python bench/virtual_sweep.py [--preset llm-d-shared-prefix] [--strategies a,b,c]
        [--rates 4,8,16,24] [--seeds 0,1] [--epp-replicas 1]

The real EPP (profiles, datastore, precise index) in front of real engine schedulers and KV
cache managers with the simulated runner's timing, on a virtual clock (kvgate.bench.
virtual_pool). Deterministic for a seed (str hashing is fixed with PYTHONHASHSEED=0 unless you
set it); several seeds are averaged. What it leaves out
(processes, HTTP, Envoy, a loaded CPU) the process bench has: `kvgate bench --compare
--simulate --preset ...` confirms what this finds.

Prints, per rate and strategy, TTFT p50/p90 (s), output tok/s and prefix hit rate, then the
candidate (--candidate, default the first strategy) as a multiple of every other strategy at the
same rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvgate.bench.presets import PRESETS
from kvgate.bench.virtual_pool import PoolSpec, simulate
from kvgate.bench.workloads import LoRASpec, MultiTurnSpec, SharedPrefixSpec, WorkloadSpec
from kvgate.engine.config import SimulationConfig

METRICS = ("ttft_p50", "ttft_p90", "output_tok_s", "prefix_hit", "lora_loads")


def workload(preset: dict[str, object], seed: int) -> WorkloadSpec:
    v = preset
    if v["workload"] == "multi-turn":
        return WorkloadSpec(
            kind="multi-turn",
            seed=seed,
            multi_turn=MultiTurnSpec(
                conversations=int(v["conversations"]),  # type: ignore[call-overload]
                turns=int(v["turns"]),  # type: ignore[call-overload]
                first_turn_tokens=int(v["first_turn_tokens"]),  # type: ignore[call-overload]
                user_turn_tokens=int(v["user_turn_tokens"]),  # type: ignore[call-overload]
                output_tokens=int(v["output_tokens"]),  # type: ignore[call-overload]
            ),
        )
    if v["workload"] == "lora":
        return WorkloadSpec(
            kind="lora",
            seed=seed,
            lora=LoRASpec(
                adapters=int(v["adapters"]),  # type: ignore[call-overload]
                zipf=float(v["adapter_zipf"]),  # type: ignore[arg-type]
                base_fraction=float(v["base_fraction"]),  # type: ignore[arg-type]
                prefix_tokens=int(v["prefix_tokens"]),  # type: ignore[call-overload]
                suffix_tokens=int(v["suffix_tokens"]),  # type: ignore[call-overload]
                output_tokens=int(v["output_tokens"]),  # type: ignore[call-overload]
            ),
        )
    return WorkloadSpec(
        kind="shared-prefix",
        seed=seed,
        shared_prefix=SharedPrefixSpec(
            int(v["groups"]),  # type: ignore[call-overload]
            int(v["prefix_tokens"]),  # type: ignore[call-overload]
            int(v["suffix_tokens"]),  # type: ignore[call-overload]
            int(v["output_tokens"]),  # type: ignore[call-overload]
        ),
    )


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") is None:
        # GIE's approximate prefix scorer hashes prompt text with hash(), salted per process:
        # one fixed salt makes every run of a seed pick alike.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"})
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llm-d-shared-prefix")
    ap.add_argument("--strategies", default="precise-prefix,precise-prefix-weights,default,round-robin")
    ap.add_argument(
        "--candidate", default=None, help="the strategy the ratios are about (default: the first)"
    )
    ap.add_argument("--rates", default=None, help="req/s, comma-separated (default: the preset's)")
    ap.add_argument("--seeds", default="0", help="comma-separated; results are averaged over them")
    ap.add_argument("--epp-replicas", type=int, default=1)
    ap.add_argument(
        "--no-admissions",
        action="store_true",
        help="engines do not announce admissions: each EPP replica sees only its own picks",
    )
    args = ap.parse_args()

    preset = PRESETS[args.preset].values
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    candidate = args.candidate or strategies[0]
    rates = [float(r) for r in (args.rates or str(preset["request_rate"])).split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    pool = PoolSpec(
        engines=int(preset["engines"]),  # type: ignore[call-overload]
        kv_blocks=int(preset.get("sim_kv_blocks", 320)),  # type: ignore[call-overload]
        # kvgate bench's simulated timing (~70B on one accelerator)
        sim=SimulationConfig(
            prefill_time_per_token=0.0004,
            itl_base=0.025,
            itl_per_seq=0.0005,
            lora_load_time=float(preset.get("sim_lora_load_time", 0.0)),  # type: ignore[arg-type]
        ),
        epp_replicas=args.epp_replicas,
        announce_admissions=not args.no_admissions,
        adapters=tuple(LoRASpec(adapters=int(preset["adapters"])).names())
        if preset["workload"] == "lora"
        else (),  # type: ignore[call-overload]
        max_loras=int(preset.get("max_loras", 2)),  # type: ignore[call-overload]
    )
    count, warmup = int(preset["num_requests"]), int(preset["warmup_requests"])  # type: ignore[call-overload]
    print(
        f"preset {args.preset}: {PRESETS[args.preset].summary}; seeds {seeds}; {args.epp_replicas} EPP replica(s)"
    )
    results: dict[tuple[float, str], dict[str, float]] = {}
    print(
        f"{'req/s':>5}  {'strategy':18}  {'TTFT p50':>8}  {'TTFT p90':>8}  {'out tok/s':>9}  {'hit':>6}  {'loads':>6}"
    )
    for rate in rates:
        for name in strategies:
            t0 = time.monotonic()
            runs = [
                simulate(name, workload(preset, seed), rate, count, warmup, pool).summary() for seed in seeds
            ]
            avg = {k: statistics.fmean(r[k] for r in runs) for k in METRICS}
            results[(rate, name)] = avg
            print(
                f"{rate:5g}  {name:18}  {avg['ttft_p50']:8.2f}  {avg['ttft_p90']:8.2f}  "
                f"{avg['output_tok_s']:9.1f}  {avg['prefix_hit'] * 100:5.1f}%  {avg['lora_loads']:6.1f}"
                f"   ({time.monotonic() - t0:.0f} s)",
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


if __name__ == "__main__":
    main()

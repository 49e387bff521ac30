"""Tenants on one pool, with and without flow control, on the virtual-clock pool.

    .venv/bin/python bench/noisy_neighbor.py [--engines 4] [--seconds 60] [--seeds 0,1]
        [--dispatch-prefill-tokens 2048] [--long-prefill-token-threshold 0]

The real EPP (Director, the default profile, datastore) and, with flow control, the real
`FlowController`, in front of real engine schedulers with the simulated runner's timing
(kvgate.bench.virtual_pool). Four runs, each against its references made in the same process:

1. noisy neighbour: tenant A sends long prompts at 3x the pool's capacity for them, tenants B
   and C short prompts at 0.15x each. B's and C's TTFT p90 with flow control, without it, and
   with each alone on the pool; the pool's output tok/s over the arrival window with and
   without flow control (work conservation), and A's share of it.
2. token fairness: two tenants both flooding, one with 8,000-token prompts, one with 500-token
   prompts: each one's share of the served tokens (prompt + output, and VTC's weighted service).
3. priority: a sheddable flood (priority -1) at 3x capacity and critical traffic (priority 1)
   at 0.15x: critical TTFT p90 against critical alone.
4. two EPP replicas: run 2 with each replica holding half the traffic, sharing service as
   engines announce it: per-tenant shares against one replica's.

Capacities are measured first, by flooding the pool with each request shape alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass

from kvgate.bench.noisy_neighbor import virtual_capacity
from kvgate.bench.virtual_pool import PoolSpec, RunResult, VirtualPool, word_token
from kvgate.bench.workloads import BenchRequest
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.epp.flow_control import FlowControlConfig

OUTPUT_TOKENS = 128


@dataclass(frozen=True)
class Tenant:
    name: str
    prompt_tokens: int
    rate: float  # requests/s
    priority: int = 0


def _requests(
    tenants: list[Tenant], seconds: float, seed: int
) -> list[tuple[float, BenchRequest, list[int]]]:
    """Poisson arrivals per tenant over `seconds`, merged; every prompt unique (no prefix
    sharing: this is about queues, not caches)."""
    rng = random.Random(f"{seed}:tenants")
    out: list[tuple[float, Tenant]] = []
    for t in tenants:
        when = 0.0
        while True:
            when += rng.expovariate(t.rate)
            if when >= seconds:
                break
            out.append((when, t))
    out.sort(key=lambda x: x[0])
    stream = []
    for index, (when, t) in enumerate(out):
        words = tuple(f"{t.name}{index}w{i}" for i in range(t.prompt_tokens))
        req = BenchRequest(
            index=index,
            messages=(),
            max_tokens=OUTPUT_TOKENS,
            group=f"{t.name}-{index}",
            nominal_words=words,
            tenant=t.name,
            priority=t.priority,
        )
        stream.append((when, req, [word_token(w) for w in words]))
    return stream


def _pool(args: argparse.Namespace, flow: FlowControlConfig | None, replicas: int = 1) -> PoolSpec:
    return PoolSpec(
        engines=args.engines,
        kv_blocks=args.kv_blocks,
        max_num_batched_tokens=2048,
        sim=SimulationConfig(prefill_time_per_token=0.0004, itl_base=0.025, itl_per_seq=0.0005),
        # (the engines' defaults unless the arguments say otherwise)
        scheduling_policy=getattr(args, "scheduling_policy", EngineConfig.scheduling_policy),
        long_prefill_token_threshold=getattr(
            args, "long_prefill_token_threshold", EngineConfig.long_prefill_token_threshold
        ),
        epp_replicas=replicas,
        flow_control=flow,
    )


def _run(pool: PoolSpec, stream: list[tuple[float, BenchRequest, list[int]]]) -> RunResult:
    vp = VirtualPool(pool, "default")
    return vp.run(stream)


def capacity(args: argparse.Namespace, prompt_tokens: int) -> float:
    """Requests/s the pool completes when flooded with this shape alone (no flow control)."""
    pool = _pool(args, None)
    return virtual_capacity(pool.engines, pool.kv_blocks, pool.sim, prompt_tokens, OUTPUT_TOKENS)


def _ttft_p90(result: RunResult, tenant: str) -> float:
    values = sorted(r.ttft for r in result.done() if r.tenant == tenant)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else float("nan")


def _window_tokens(result: RunResult, start: float, end: float) -> dict[str, float]:
    """Output tokens produced in [start, end) per tenant (a request's tokens spread evenly from
    its first to its last)."""
    per: dict[str, float] = {}
    for r in result.done():
        assert r.first_token is not None and r.finished is not None
        n = r.output_tokens
        step = (r.finished - r.first_token) / max(1, n - 1)
        inside = sum(1 for i in range(n) if start <= r.first_token + i * step < end)
        per[r.tenant] = per.get(r.tenant, 0.0) + inside
    return per


def _served(
    result: RunResult, start: float, end: float, prompt_w: float = 1.0, out_w: float = 1.0
) -> dict[str, float]:
    """Tokens served per tenant to requests that started in the window: prompt + output."""
    per: dict[str, float] = {}
    for r in result.done():
        if r.dispatched is not None and start <= r.dispatched < end:
            per[r.tenant] = per.get(r.tenant, 0.0) + prompt_w * r.prompt_tokens + out_w * r.output_tokens
    return per


def _shares(per: dict[str, float]) -> dict[str, float]:
    total = sum(per.values()) or 1.0
    return {k: v / total for k, v in sorted(per.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=1800)
    ap.add_argument("--seconds", type=float, default=60.0, help="arrival window, virtual seconds")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--short-tokens", type=int, default=256)
    # the product's defaults (FlowControlConfig, EngineConfig) unless given
    fc, ec = FlowControlConfig(), EngineConfig()
    ap.add_argument("--dispatch-prefill-tokens", type=int, default=fc.dispatch_prefill_tokens)
    ap.add_argument("--dispatch-queue-depth", type=int, default=fc.dispatch_queue_depth)
    ap.add_argument("--dispatch", choices=["pool", "endpoint"], default=fc.dispatch)
    ap.add_argument("--max-unconfirmed-picks", type=int, default=fc.max_unconfirmed_picks)
    ap.add_argument(
        "--short-reserve", type=int, default=fc.short_reserve, help="engines kept free of long prompts"
    )
    ap.add_argument("--ttl", type=float, default=fc.ttl_s)
    ap.add_argument("--scheduling-policy", choices=["fcfs", "priority", "fair"], default=ec.scheduling_policy)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=ec.long_prefill_token_threshold)
    ap.add_argument("--only", default="1,2,3,4", help="which runs (comma-separated)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {int(x) for x in args.only.split(",")}
    flow = FlowControlConfig(
        dispatch=args.dispatch,
        ttl_s=args.ttl,
        dispatch_prefill_tokens=args.dispatch_prefill_tokens,
        dispatch_queue_depth=args.dispatch_queue_depth,
        max_unconfirmed_picks=args.max_unconfirmed_picks,
        short_reserve=args.short_reserve,
        short_prompt_tokens=args.short_tokens,
    )
    cap_long = capacity(args, args.long_tokens)
    cap_short = capacity(args, args.short_tokens)
    print(
        f"pool: {args.engines} engines; capacity {cap_long:.2f} req/s of {args.long_tokens}-token prompts, "
        f"{cap_short:.2f} req/s of {args.short_tokens}-token prompts ({OUTPUT_TOKENS} output tokens each)"
    )
    warm, end = 0.2 * args.seconds, args.seconds

    if 1 in runs:
        a = Tenant("A", args.long_tokens, 3 * cap_long)
        b = Tenant("B", args.short_tokens, 0.15 * cap_short)
        c = Tenant("C", args.short_tokens, 0.15 * cap_short)
        rows: dict[str, list[float]] = {}
        for seed in seeds:
            mixed = _requests([a, b, c], args.seconds, seed)
            with_fc = _run(_pool(args, flow), mixed)
            without = _run(_pool(args, None), mixed)
            for t in (b, c):
                alone = _run(_pool(args, flow), _requests([t], args.seconds, seed + 100))
                base = _ttft_p90(alone, t.name)
                rows.setdefault(f"{t.name} alone p90 s", []).append(base)
                rows.setdefault(f"{t.name} flow-control p90 / alone", []).append(
                    _ttft_p90(with_fc, t.name) / base
                )
                rows.setdefault(f"{t.name} no-flow-control p90 / alone", []).append(
                    _ttft_p90(without, t.name) / base
                )
            fc_tok, no_tok = _window_tokens(with_fc, warm, end), _window_tokens(without, warm, end)
            span = end - warm
            rows.setdefault("pool output tok/s, flow control", []).append(sum(fc_tok.values()) / span)
            rows.setdefault("pool output tok/s, none", []).append(sum(no_tok.values()) / span)
            rows.setdefault("output ratio flow control / none", []).append(
                sum(fc_tok.values()) / sum(no_tok.values())
            )
            rows.setdefault("A share of output, flow control", []).append(
                fc_tok.get("A", 0) / sum(fc_tok.values())
            )
            rejected = [r for r in with_fc.records if r.status != 200]
            rows.setdefault("A rejected (TTL/queue), flow control", []).append(
                sum(1 for r in rejected if r.tenant == "A")
            )
            rows.setdefault("B+C rejected, flow control", []).append(
                sum(1 for r in rejected if r.tenant != "A")
            )
        _print("1. noisy neighbour: A at 3x capacity, B and C at 0.15x", rows, seeds)

    if 2 in runs or 4 in runs:
        big = Tenant("big", 8000, 1.5 * capacity(args, 8000))
        small = Tenant("small", 500, 1.5 * capacity(args, 500))
        rows = {}
        for seed in seeds:
            stream = _requests([big, small], args.seconds, seed)
            one = _run(_pool(args, flow), stream)
            served = _shares(_served(one, warm, end))
            weighted = _shares(_served(one, warm, end, flow.prompt_token_weight, flow.output_token_weight))
            if 2 in runs:
                for name in ("big", "small"):
                    rows.setdefault(f"{name} share of served tokens", []).append(served.get(name, 0.0))
                    rows.setdefault(f"{name} share of VTC service", []).append(weighted.get(name, 0.0))
            if 4 in runs:
                two = _run(_pool(args, flow, replicas=2), stream)
                two_w = _shares(_served(two, warm, end, flow.prompt_token_weight, flow.output_token_weight))
                for name in ("big", "small"):
                    rows.setdefault(f"2 replicas: {name} VTC share / 1 replica's", []).append(
                        two_w.get(name, 0.0) / max(1e-9, weighted.get(name, 0.0))
                    )
        _print(
            "2/4. token fairness: 8,000-token against 500-token prompts, both at 1.5x capacity", rows, seeds
        )

    if 3 in runs:
        flood = Tenant("flood", args.long_tokens, 3 * cap_long, priority=-1)
        critical = Tenant("critical", args.short_tokens, 0.15 * cap_short, priority=1)
        rows = {}
        for seed in seeds:
            mixed = _requests([flood, critical], args.seconds, seed)
            with_fc = _run(_pool(args, flow), mixed)
            without = _run(_pool(args, None), mixed)
            alone = _run(_pool(args, flow), _requests([critical], args.seconds, seed + 100))
            base = _ttft_p90(alone, "critical")
            rows.setdefault("critical alone p90 s", []).append(base)
            rows.setdefault("critical p90 / alone, flow control", []).append(
                _ttft_p90(with_fc, "critical") / base
            )
            rows.setdefault("critical p90 / alone, none", []).append(_ttft_p90(without, "critical") / base)
        _print("3. priority: sheddable flood at 3x, critical at 0.15x", rows, seeds)
    return 0


def _print(title: str, rows: dict[str, list[float]], seeds: list[int]) -> None:
    print(f"\n{title} (mean over seeds {','.join(map(str, seeds))}; per seed in brackets)")
    for name, values in rows.items():
        per = " ".join(f"{v:.3g}" for v in values)
        print(f"  {name:44s} {statistics.fmean(values):9.3f}   [{per}]")


if __name__ == "__main__":
    sys.exit(main())

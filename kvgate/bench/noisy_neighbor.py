"""`kvgate bench --preset noisy-neighbor`: tenants sharing one pool, through the real stack.

bench/noisy_neighbor.py's experiment on processes (simulated engines, the real EPP, real Envoy)
instead of the virtual clock. A tenants file with a random key per tenant is written to the log
folder; each tenant's requests carry its own key (`Authorization: Bearer`), arrive as a Poisson
process at its own rate, all tenants at once, each with its own prompt shape:

- noisy neighbour: tenant A sends long unique prompts at 3x the pool's capacity for them, B and
  C short prompts at 0.15x each; with flow control, without it, and B and C each alone;
- priority: tenant `flood` (priority -1, sheddable) sends long prompts at 3x, `critical`
  (priority 1) short ones at 0.15x; with flow control, without, and critical alone.

Rates are multiples of the pool's capacity for each shape, derived from the simulated engines'
timing before any stack starts: the virtual-clock pool (kvgate.bench.virtual_pool: the same
engine scheduler, KV cache and step timing as the stack's engines, no processes) is flooded with
each shape alone, without flow control, as bench/noisy_neighbor.py does.

Two stacks: one with flow control (its EPP at the defaults a user gets, then the bench's
--epp-arg flags) runs the
alone runs, the noisy-neighbour run and the priority run in turn; one with --no-flow-control
runs the noisy-neighbour and the priority runs. Every run sends for --duration seconds and then
waits for its requests to end (without flow control the flood's backlog drains at the pool's
capacity: about twice --duration more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from kvgate.bench import report
from kvgate.bench.preset_main import PresetError, preset_main
from kvgate.bench.stats import RequestResult, Slo, Summary, ratio, summarize, window_tokens
from kvgate.bench.workloads import BenchRequest, ChatMessage, unique_prompt_words

if TYPE_CHECKING:
    from kvgate.engine.config import SimulationConfig

PRESET = "noisy-neighbor"
LONG_MULTIPLE = 3.0  # the flooding tenant's rate, in multiples of the pool's capacity
SHORT_MULTIPLE = 0.15  # each light tenant's
# Throughput is counted over the arrival window less its first fifth (queues filling up).
WINDOW_START = 0.2
# The flow-control stack's EPP flags: none, the defaults a user gets; --epp-arg adds to them.
FLOW_ARGS: tuple[str, ...] = ()

ALONE = "alone"
FLOW = "flow control"
NO_FLOW = "no flow control"
PRIO_FLOW = "priority, flow control"
PRIO_NO_FLOW = "priority, no flow control"
LIGHT = ("B", "C")
# Arrival seeds: one Poisson stream per tenant, the same in every run it takes part in (so a
# tenant alone and the same tenant beside a flood see the same arrival times).
_SEED_SLOT = {"A": 1, "B": 2, "C": 3, "flood": 4, "critical": 5}


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's part of a run: its prompt shape, Poisson rate and priority."""

    name: str
    prompt_tokens: int
    rate: float  # requests/s
    priority: int = 0
    seed: int = 0  # its arrival stream's


@dataclass(frozen=True)
class PlannedRun:
    name: str
    flow_control: bool  # which stack runs it
    tenants: tuple[TenantLoad, ...]


@dataclass(frozen=True)
class Capacity:
    long_req_s: float
    short_req_s: float
    long_tokens: int
    short_tokens: int
    output_tokens: int
    source: str  # how it was obtained, for the report


def tenant_priorities() -> dict[str, int]:
    return {"A": 0, "B": 0, "C": 0, "flood": -1, "critical": 1}


def plan_runs(cap: Capacity, seed: int) -> list[PlannedRun]:
    """Every run of the preset, in the order they go: the flow-control stack's, then the other's."""
    prio = tenant_priorities()

    def load(name: str, long: bool) -> TenantLoad:
        return TenantLoad(
            name,
            cap.long_tokens if long else cap.short_tokens,
            (LONG_MULTIPLE * cap.long_req_s) if long else (SHORT_MULTIPLE * cap.short_req_s),
            prio[name],
            seed * 100 + _SEED_SLOT[name],
        )

    a, b, c = load("A", True), load("B", False), load("C", False)
    flood, critical = load("flood", True), load("critical", False)
    return [
        PlannedRun(ALONE, True, (b,)),
        PlannedRun(ALONE, True, (c,)),
        PlannedRun(ALONE, True, (critical,)),
        PlannedRun(FLOW, True, (a, b, c)),
        PlannedRun(PRIO_FLOW, True, (flood, critical)),
        PlannedRun(NO_FLOW, False, (a, b, c)),
        PlannedRun(PRIO_NO_FLOW, False, (flood, critical)),
    ]


def tenants_file_text(
    names: Sequence[str], token: Callable[[], str] | None = None
) -> tuple[str, dict[str, str]]:
    """A tenants file (YAML) for these tenants with a fresh random key each; and the keys."""
    token = token or (lambda: secrets.token_urlsafe(24))
    prio = tenant_priorities()
    keys = {name: f"kvgate-bench-{name}-{token()}" for name in names}
    doc = [{"name": n, "key": keys[n], "weight": 1.0, "priority": prio.get(n, 0)} for n in names]
    return yaml.safe_dump(doc, sort_keys=False), keys


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def tenant_requests(run: str, load: TenantLoad, output_tokens: int) -> Iterator[BenchRequest]:
    """An endless stream of this tenant's requests in this run: every prompt unique from its
    first word (no prefix sharing across tenants, runs or requests: this is about queues)."""
    rng = random.Random(f"{load.seed}:{run}:{load.name}:prompts")
    tag = f"{_slug(run)}-{load.name}"
    index = 0
    while True:
        words = unique_prompt_words(rng, f"{tag}-{index}", load.prompt_tokens)
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("user", " ".join(words)),),
            max_tokens=output_tokens,
            group=f"{load.name}-{index}",
            nominal_words=tuple(words),
            tenant=load.name,
            priority=load.priority,
        )
        index += 1


@dataclass
class TenantRow:
    """One tenant in one run."""

    run: str
    tenant: str
    priority: int
    prompt_tokens: int
    offered_req_s: float
    summary: Summary
    window_tok_s: float  # output tokens/s over the arrival window less its first fifth
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def counts(self) -> dict[str, int]:
        ok = sum(1 for r in self.results if r.ok)
        r429 = sum(1 for r in self.results if not r.ok and r.status == 429)
        r503 = sum(1 for r in self.results if not r.ok and r.status == 503)
        return {
            "sent": len(self.results),
            "ok": ok,
            "429": r429,
            "503": r503,
            "other": len(self.results) - ok - r429 - r503,
        }

    def record(self) -> dict[str, object]:
        return {
            "run": self.run,
            "tenant": self.tenant,
            "priority": self.priority,
            "prompt_tokens": self.prompt_tokens,
            "offered_req_s": self.offered_req_s,
            "window_output_tok_s": self.window_tok_s,
            **{f"requests_{k}": v for k, v in self.counts().items()},
            **self.summary.as_record(),
        }


def tenant_row(
    run: str, load: TenantLoad, results: list[RequestResult], duration_s: float, window: float, slo: Slo
) -> TenantRow:
    """`window`: the seconds of arrivals (--duration); `duration_s`: until the last request ended."""
    summary = summarize(f"{run}/{load.name}", results, duration_s, slo, request_rate=load.rate)
    start = WINDOW_START * window
    tok_s = window_tokens(results, start, window) / max(window - start, 1e-9)
    return TenantRow(run, load.name, load.priority, load.prompt_tokens, load.rate, summary, tok_s, results)


@dataclass(frozen=True)
class Ratio:
    """A tenant's figures in a run as multiples of its figures alone (None: not measurable)."""

    tenant: str
    run: str
    ttft_p50: float | None
    ttft_p90: float | None
    itl_p50: float | None
    itl_p90: float | None
    tok_s: float | None


def ratios(rows: Sequence[TenantRow]) -> list[Ratio]:
    """Every tenant that ran alone: its other runs against that one."""
    alone = {r.tenant: r for r in rows if r.run == ALONE}
    out = []
    for r in rows:
        base = alone.get(r.tenant)
        if base is None or r is base:
            continue
        s, b = r.summary, base.summary
        out.append(
            Ratio(
                r.tenant,
                r.run,
                ratio(s.ttft_p50_s, b.ttft_p50_s),
                ratio(s.ttft_p90_s, b.ttft_p90_s),
                ratio(s.itl_p50_s, b.itl_p50_s),
                ratio(s.itl_p90_s, b.itl_p90_s),
                ratio(r.window_tok_s, base.window_tok_s),
            )
        )
    return out


def pool_tok_s(rows: Sequence[TenantRow], run: str) -> float:
    return sum(r.window_tok_s for r in rows if r.run == run)


# -- capacity ---------------------------------------------------------------------------------


def virtual_capacity(
    engines: int,
    kv_blocks: int,
    sim: SimulationConfig,
    prompt_tokens: int,
    output_tokens: int,
    max_num_seqs: int | None = None,
    profile: str = "default",
) -> float:
    """Requests/s the virtual-clock pool completes when flooded with this shape alone (no flow
    control): the middle 60% of the completions over the time they took (bench/noisy_neighbor.py's
    measure). `sim`: the engines' SimulationConfig."""
    from kvgate.bench.virtual_pool import PoolSpec, VirtualPool, word_token

    # enough for a steady middle: every engine's batch full several times over
    count = engines * max(24, min(80_000 // prompt_tokens, 4 * (max_num_seqs or 128)))
    rng = random.Random("capacity")
    stream = []
    for index in range(count):
        words = tuple(f"cap{index}w{i}" for i in range(prompt_tokens))
        req = BenchRequest(index, (), output_tokens, f"cap-{index}", nominal_words=words, tenant="cap")
        stream.append((rng.uniform(0.0, 0.1), req, [word_token(w) for w in words]))
    stream.sort(key=lambda x: x[0])
    spec = PoolSpec(engines=engines, kv_blocks=kv_blocks, sim=sim)
    if max_num_seqs is not None:
        spec.max_num_seqs = max_num_seqs
    result = VirtualPool(spec, profile).run(stream)
    done = sorted(r.finished for r in result.done() if r.finished is not None)
    if len(done) < 5:
        raise PresetError(
            f"the capacity flood of {prompt_tokens}-token prompts completed {len(done)} requests"
        )
    lo, hi = len(done) // 5, len(done) - 1 - len(done) // 5
    return (hi - lo) / (done[hi] - done[lo])


def measure_capacity(args: argparse.Namespace, engines: int) -> Capacity:
    from kvgate.api.cli_args import SimTiming
    from kvgate.engine.config import SimulationConfig

    sim = SimulationConfig().with_timing(SimTiming.from_args(args))
    long_tokens, short_tokens = args.min_long_tokens, args.min_prompt_tokens
    profile = _profile(args)
    return Capacity(
        long_req_s=virtual_capacity(
            engines, sim.num_kv_blocks, sim, long_tokens, args.output_tokens, args.max_num_seqs, profile
        ),
        short_req_s=virtual_capacity(
            engines, sim.num_kv_blocks, sim, short_tokens, args.output_tokens, args.max_num_seqs, profile
        ),
        long_tokens=long_tokens,
        short_tokens=short_tokens,
        output_tokens=args.output_tokens,
        source=(
            "derived from the simulated engines' timing: the virtual-clock pool of the same engines "
            "(scheduler, KV blocks, step times) flooded with each shape alone, no flow control"
        ),
    )


def _profile(args: argparse.Namespace) -> str:
    from kvgate.bench.strategies import STRATEGIES

    name = args.profile or "default"
    return STRATEGIES.get(name, name)


# -- running ----------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    """ValueError for what this preset cannot do."""
    if args.url or args.stack_file:
        raise ValueError(f"--preset {PRESET} starts its own stacks; drop --url/--stack-file")
    if args.compare or args.pd:
        raise ValueError(f"--preset {PRESET} compares flow control with none on its own; drop --compare/--pd")
    if not args.simulate:
        raise ValueError(f"--preset {PRESET} derives its rates from the simulated timing: add --simulate")
    if args.duration is None or args.duration <= 0:
        raise ValueError("--duration must be > 0")
    if args.min_long_tokens <= args.min_prompt_tokens:
        raise ValueError(
            "the flooding tenants' prompts (--min-long-tokens) must be longer than the light ones'"
        )
    if args.min_prompt_tokens < 1 or args.output_tokens < 1:
        raise ValueError("--min-prompt-tokens and --output-tokens must be at least 1")
    if (args.engines or 4) < 1:
        raise ValueError("--engines must be at least 1")


def flow_args(cap: Capacity, extra: Sequence[str]) -> list[str]:
    """The flow-control stack's EPP flags: the preset's (none: the defaults), then --epp-arg."""
    return [*FLOW_ARGS, *extra]


@dataclass
class NoisyNeighborResult:
    rows: list[TenantRow]
    capacity: Capacity
    settings: dict[str, object]
    flow_epp_args: list[str]

    def all_ok_enough(self) -> bool:
        """Every light tenant (and critical) completed something in every run."""
        return all(r.counts()["ok"] > 0 for r in self.rows if r.tenant not in ("A", "flood"))


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def _drive(
    base_url: str,
    model: str,
    keys: dict[str, str],
    run: PlannedRun,
    duration: float,
    output_tokens: int,
    on_result: Callable[[RequestResult], None],
) -> list[tuple[list[RequestResult], float]]:
    from kvgate.bench.loadgen import LoadSpec, Target, run_load

    async def one(t: TenantLoad) -> tuple[list[RequestResult], float]:
        target = Target(base_url=base_url, model=model, api_key=keys[t.name])
        load = LoadSpec(request_rate=t.rate, duration_s=duration, seed=t.seed)
        return await run_load(target, tenant_requests(run.name, t, output_tokens), load, on_result=on_result)

    return list(await asyncio.gather(*(one(t) for t in run.tenants)))


def run_preset(args: argparse.Namespace, slo: Slo, progress: bool | None) -> NoisyNeighborResult:
    from kvgate.bench.runner import _Progress
    from kvgate.local.ports import PortBusyError, plan_ports
    from kvgate.local.stack import LocalStack, SimTiming, StackConfig, StackError

    check_args(args)
    engines = args.engines or 4
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_root = Path(args.log_dir) if args.log_dir else Path("bench") / "results" / f"logs-{stamp}"
    log_root.mkdir(parents=True, exist_ok=True)
    _say(f"component logs under {log_root}")
    t0 = time.monotonic()
    cap = measure_capacity(args, engines)
    _say(
        f"capacity ({time.monotonic() - t0:.0f}s on the virtual-clock pool): {cap.long_req_s:.2f} req/s of "
        f"{cap.long_tokens:,}-token prompts, {cap.short_req_s:.2f} req/s of {cap.short_tokens:,}-token prompts"
    )
    runs = plan_runs(cap, args.seed)
    names = list(tenant_priorities())
    text, keys = tenants_file_text(names)
    tenants_path = (log_root / "tenants.yaml").resolve()
    tenants_path.unlink(missing_ok=True)
    with os.fdopen(os.open(tenants_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)  # the keys: readable by their owner only
    extra = tuple(getattr(args, "epp_arg", None) or ())
    fc_args = flow_args(cap, extra)
    profile = _profile(args)
    replicas = max(1, int(getattr(args, "epp_replicas", 1) or 1))
    rows: list[TenantRow] = []
    for flow_control in (True, False):
        stack_name = "flow-control" if flow_control else "no-flow-control"
        cfg = StackConfig(
            ports=plan_ports(0, 0, engines, replicas),
            engines=engines,
            epp_replicas=replicas,
            model=args.engine_model,
            simulate=True,
            sim=SimTiming.from_args(args),
            profile=None if args.epp_config else profile,
            epp_config_file=str(Path(args.epp_config).resolve()) if args.epp_config else None,
            max_num_seqs=args.max_num_seqs,
            envoy_bin=args.envoy_bin,
            log_dir=log_root / stack_name,
            expose_upstream_header=True,
            ready_timeout_s=args.ready_timeout,
            tenants_file=str(tenants_path),
            flow_control=flow_control,
            epp_args=tuple(fc_args) if flow_control else extra,
        )
        stack = LocalStack(cfg, echo=None, progress=lambda m: None)
        try:
            _say(
                f"{stack_name}: starting {engines} simulated engine(s), the EPP (profile {profile}"
                + (f", {' '.join(fc_args)}" if flow_control else ", --no-flow-control")
                + ") and Envoy"
            )
            try:
                info = stack.start()
            except PortBusyError as exc:
                raise PresetError(str(exc)) from None
            except StackError as exc:
                raise PresetError(str(exc), exc.details) from None
            for run in (r for r in runs if r.flow_control == flow_control):
                who = ", ".join(
                    f"{t.name} {t.rate:.2f} req/s x {t.prompt_tokens} tokens" for t in run.tenants
                )
                _say(f"{run.name}: {who}, {args.duration:g} s of arrivals")
                bar = _Progress(None, run.name, progress)
                try:
                    outs = asyncio.run(
                        _drive(
                            info.gateway_url, info.model, keys, run, args.duration, args.output_tokens, bar
                        )
                    )
                finally:
                    bar.close()
                for t, (results, duration) in zip(run.tenants, outs, strict=True):
                    rows.append(tenant_row(run.name, t, results, duration, args.duration, slo))
                time.sleep(0.5)  # the engines' metrics and the EPP's scrape settle before the next run
        finally:
            stack.stop()
    settings: dict[str, object] = {
        "preset": PRESET,
        "engines": engines,
        "epp_replicas": replicas,
        "profile": profile,
        "duration": args.duration,
        "seed": args.seed,
        "output_tokens": args.output_tokens,
        "long_prompt_tokens": cap.long_tokens,
        "short_prompt_tokens": cap.short_tokens,
        "long_multiple": LONG_MULTIPLE,
        "short_multiple": SHORT_MULTIPLE,
        "window_start_s": WINDOW_START * args.duration,
        "flow_control_epp_args": fc_args,
        "epp_args": list(extra),
        "tenants_file": str(tenants_path),
        **{
            k: getattr(args, k, None)
            for k in "sim_prefill_time_per_token sim_itl sim_itl_per_seq sim_kv_blocks sim_time_scale max_num_seqs".split()
        },
    }
    return NoisyNeighborResult(rows, cap, settings, fc_args)


# -- report -----------------------------------------------------------------------------------


TABLE_HEADERS = [
    "run",
    "tenant",
    "prio",
    "prompt",
    "req/s",
    "sent",
    "ok",
    "429",
    "503",
    "err",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "out tok/s",
]


def table_rows(rows: Sequence[TenantRow]) -> list[list[str]]:
    out = []
    for r in rows:
        c, s = r.counts(), r.summary
        out.append(
            [
                r.run,
                r.tenant,
                str(r.priority),
                str(r.prompt_tokens),
                f"{r.offered_req_s:.2f}",
                str(c["sent"]),
                str(c["ok"]),
                str(c["429"]),
                str(c["503"]),
                str(c["other"]),
                report.ms(s.ttft_p50_s),
                report.ms(s.ttft_p90_s),
                report.ms(s.itl_p50_s),
                report.ms(s.itl_p90_s),
                f"{r.window_tok_s:.1f}",
            ]
        )
    return out


RATIO_HEADERS = ["tenant", "run / alone", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "out tok/s"]


def ratio_rows(found: Sequence[Ratio]) -> list[list[str]]:
    return [
        [
            q.tenant,
            q.run,
            report.times(q.ttft_p50),
            report.times(q.ttft_p90),
            report.times(q.itl_p50),
            report.times(q.itl_p90),
            report.times(q.tok_s),
        ]
        for q in found
    ]


def summary_lines(result: NoisyNeighborResult) -> list[str]:
    rows = result.rows
    lines = []
    fc, none = pool_tok_s(rows, FLOW), pool_tok_s(rows, NO_FLOW)
    span = result.settings.get("window_start_s")
    if fc or none:

        def share(run: str) -> str:
            total = pool_tok_s(rows, run)
            a = sum(r.window_tok_s for r in rows if r.run == run and r.tenant == "A")
            return f"{a / total * 100:.0f}%" if total else "-"

        lines.append(
            f"pool output tok/s from {span:g} s to the end of arrivals: flow control {fc:.1f}, none {none:.1f} "
            f"({report.times(ratio(fc, none))}); A's share {share(FLOW)} with flow control, {share(NO_FLOW)} without"
        )
    by = {(r.run, r.tenant): r for r in rows}
    base = by.get((ALONE, "critical"))
    if base is not None and base.summary.ttft_p90_s is not None:
        parts = []
        for run, what in ((PRIO_FLOW, "with flow control"), (PRIO_NO_FLOW, "without")):
            r = by.get((run, "critical"))
            if r is not None and r.summary.ttft_p90_s is not None:
                parts.append(
                    f"{what} {report.times(ratio(r.summary.ttft_p90_s, base.summary.ttft_p90_s))} "
                    f"({report.ms(r.summary.ttft_p90_s)} ms)"
                )
        flood = by.get((PRIO_FLOW, "flood"))
        shed = ""
        if flood is not None:
            c = flood.counts()
            shed = f"; the flood with flow control: {c['429']} of {c['sent']} refused 429 (sheddable)"
        lines.append(
            f"critical TTFT p90 during the sheddable flood vs alone ({report.ms(base.summary.ttft_p90_s)} ms): "
            + ", ".join(parts)
            + shed
        )
    return lines


def print_report(args: argparse.Namespace, result: NoisyNeighborResult, started: str) -> None:
    cap, s = result.capacity, result.settings
    print(
        f"noisy-neighbor: {s['engines']} simulated engine(s) ({s['sim_kv_blocks']:,} KV blocks each), EPP profile "
        f"{s['profile']}, tenants with their own API keys, {s['duration']:g} s of Poisson arrivals per run, "
        f"seed {s['seed']}"
    )
    print(
        f"capacity ({cap.source}): {cap.long_req_s:.2f} req/s of {cap.long_tokens:,}-token prompts, "
        f"{cap.short_req_s:.2f} req/s of {cap.short_tokens:,}-token prompts, {cap.output_tokens} output tokens "
        f"each; A and flood at {LONG_MULTIPLE:g}x, B, C and critical at {SHORT_MULTIPLE:g}x"
    )
    print(f"flow control: {' '.join(result.flow_epp_args)}; out tok/s counted from {s['window_start_s']:g} s")
    print()
    print(report.plain_table(TABLE_HEADERS, table_rows(result.rows), left=2))
    found = ratios(result.rows)
    if found:
        print()
        print("each tenant against itself alone (< 1x is better for latency, > 1x for throughput)")
        print(report.plain_table(RATIO_HEADERS, ratio_rows(found), left=2))
    lines = summary_lines(result)
    if lines:
        print()
        for line in lines:
            print(line)
    if args.markdown:
        print()
        print(report.markdown_rows(TABLE_HEADERS, table_rows(result.rows)))
        if found:
            print()
            print(report.markdown_rows(RATIO_HEADERS, ratio_rows(found)))
    if args.json:
        path = Path(args.json)
        write_json(path, result, started)
        print(f"results: {path}")
        for r in result.rows:
            report.write_requests_jsonl(
                path.parent / f"requests-{_slug(r.run)}-{r.tenant}.jsonl", f"{r.run}/{r.tenant}", r.results
            )
    if args.plot:
        from kvgate.bench import plots

        plot_dir = Path(args.plot)
        for written in (
            plots.tenant_ttft_cdfs(plot_dir / "tenants_ttft_cdf.png", _by_tenant(result.rows)),
            plots.tenant_bars(
                plot_dir / "tenants.png", _figures(result.rows), (FLOW, NO_FLOW, PRIO_FLOW, PRIO_NO_FLOW)
            ),
        ):
            print(f"chart: {written}")


def _by_tenant(rows: Sequence[TenantRow]) -> dict[str, dict[str, list[RequestResult]]]:
    out: dict[str, dict[str, list[RequestResult]]] = {}
    for r in rows:
        out.setdefault(r.tenant, {})[r.run] = r.results
    return out


def _figures(rows: Sequence[TenantRow]) -> dict[str, dict[str, tuple[float | None, float]]]:
    out: dict[str, dict[str, tuple[float | None, float]]] = {}
    for r in rows:
        out.setdefault(r.run, {})[r.tenant] = (r.summary.ttft_p90_s, r.window_tok_s)
    return out


def write_json(path: Path, result: NoisyNeighborResult, started: str) -> None:
    cap = result.capacity
    doc = {
        "preset": PRESET,
        "settings": {**result.settings, "started": started},
        "capacity": {
            "long_req_s": cap.long_req_s,
            "short_req_s": cap.short_req_s,
            "long_tokens": cap.long_tokens,
            "short_tokens": cap.short_tokens,
            "output_tokens": cap.output_tokens,
            "source": cap.source,
        },
        "rows": [r.record() for r in result.rows],
        "ratios": [q.__dict__ for q in ratios(result.rows)],
        "pool_output_tok_s": {FLOW: pool_tok_s(result.rows, FLOW), NO_FLOW: pool_tok_s(result.rows, NO_FLOW)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def main(args: argparse.Namespace, slo: Slo, progress: bool | None) -> int:
    """`kvgate bench --preset noisy-neighbor` after the preset filled its flags."""
    return preset_main(
        args,
        check_args,
        lambda: run_preset(args, slo, progress),
        print_report,
        lambda result: result.all_ok_enough(),
    )

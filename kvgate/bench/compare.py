"""Routing-strategy comparison: a fresh local stack per strategy, the same workload and seed each time."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.bench.loadgen import LoadSpec, Target
from kvgate.bench.runner import RunOutcome, engine_block_size, ideal_hit_rate, measure, sent_requests
from kvgate.bench.stats import Slo
from kvgate.bench.strategies import STRATEGIES
from kvgate.bench.workloads import BenchRequest, WorkloadSpec
from kvgate.local.ports import plan_ports
from kvgate.local.stack import LocalStack, StackConfig


def parse_strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise ValueError(
            f"unknown strategy {', '.join(unknown) or '(none)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


@dataclass(frozen=True)
class StackTemplate:
    """Everything about the stack except its ports, profile and log folder."""

    base: StackConfig

    def for_strategy(self, strategy: str, log_dir: Path) -> StackConfig:
        return replace(
            self.base,
            ports=plan_ports(0, 0, self.base.engines, self.base.epp_replicas),
            profile=STRATEGIES[strategy],
            epp_config_file=None,
            log_dir=log_dir,
        )


def run_on_fresh_stack(
    label: str,
    cfg: StackConfig,
    workload: WorkloadSpec,
    loads: Sequence[LoadSpec],
    slo: Slo,
    say: Callable[[str], None],
    progress: bool | None = None,
) -> list[RunOutcome]:
    """Start a stack, measure each load in turn through its gateway, stop it (also on errors)."""
    stack = LocalStack(cfg, echo=None, progress=lambda m: None)
    try:
        kind = "simulated" if cfg.simulate else cfg.model
        say(f"{label}: starting {cfg.engines} {kind} engine(s), the EPP (profile {cfg.profile}) and Envoy")
        info = stack.start()
        block = engine_block_size(info.engine_metrics_urls)
        target = Target(base_url=info.gateway_url, model=info.model)
        outcomes = []
        for load in loads:
            outcome = measure(label, target, workload, load, slo, info.engine_metrics_urls, progress)
            outcome.block_size = block
            outcome.model = info.model
            outcomes.append(outcome)
        return outcomes
    finally:
        stack.stop()


def compare(
    strategies: Sequence[str],
    template: StackTemplate,
    workload: WorkloadSpec,
    loads: Sequence[LoadSpec],
    slo: Slo,
    log_root: Path,
    say: Callable[[str], None] = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True),
    progress: bool | None = None,
) -> list[RunOutcome]:
    """Each strategy on its own fresh stack (same workload, seed and loads)."""
    outcomes: list[RunOutcome] = []
    for name in strategies:
        cfg = template.for_strategy(name, log_root / name)
        outcomes += run_on_fresh_stack(name, cfg, workload, loads, slo, say, progress)
    return outcomes


def fill_ideal_hit_rates(
    outcomes: Sequence[RunOutcome], workload: WorkloadSpec, tokenizer_model: str | None
) -> str:
    """Set each summary's best achievable hit rate; returns how prompts were tokenized."""
    note = ""
    # Runs with one label share a stack, one load after another: what an earlier load sent is
    # cached there already (a sweep replays the same prompts), so it counts as history too.
    sent_before: dict[str, list[BenchRequest]] = {}
    for o in outcomes:
        # Per run: in a --duration run each may have sent a different number of requests.
        warmup, requests = sent_requests(workload, o.load, o.results)
        history = sent_before.setdefault(o.label, [])
        o.summary.ideal_prefix_hit_rate, note = ideal_hit_rate(
            requests, tokenizer_model, o.block_size, [*history, *warmup]
        )
        history += [*warmup, *requests]
    return note

"""One measured run: drive the load, read the engines' prefix-cache counters around it, summarize."""

from __future__ import annotations

import asyncio
import functools
import itertools
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import httpx

from kvgate.bench import engine_metrics
from kvgate.bench.loadgen import LoadSpec, Target, run_load
from kvgate.bench.stats import RequestResult, Slo, Summary, ideal_prefix_hit_rate, summarize
from kvgate.bench.workloads import BenchRequest, WorkloadSpec, generate

if TYPE_CHECKING:
    from kvgate.api.tokenizer import Tokenizer

DEFAULT_BLOCK_SIZE = 16
_BLOCK_SIZE_LABEL = re.compile(r'block_size="(\d+)"')


@dataclass
class RunOutcome:
    label: str
    results: list[RequestResult]
    summary: Summary
    counters: dict[str, float]  # engine counter deltas over the run
    load: LoadSpec
    block_size: int = DEFAULT_BLOCK_SIZE
    model: str | None = None


def planned_requests(workload: WorkloadSpec, load: LoadSpec) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up requests, the requests the measured run may send: all for a count, enough for a duration)."""
    if load.num_requests is not None:
        n = load.num_requests
    else:
        assert load.duration_s is not None
        rate = load.request_rate or 50.0 * (load.concurrency or 1)
        n = int(load.duration_s * rate * 3) + 100
    stream = list(itertools.islice(generate(workload), load.warmup_requests + n))
    return stream[: load.warmup_requests], stream[load.warmup_requests :]


def engine_block_size(metrics_urls: Sequence[str]) -> int:
    """Block size from `vllm:cache_config_info{block_size=...}` of the first engine that answers."""
    for url in metrics_urls:
        try:
            text = httpx.get(url, timeout=5.0).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info") and (match := _BLOCK_SIZE_LABEL.search(line)):
                return int(match.group(1))
    return DEFAULT_BLOCK_SIZE


def ideal_hit_rate(
    requests: Sequence[BenchRequest], model: str | None, block_size: int, history: Sequence[BenchRequest] = ()
) -> tuple[float | None, str]:
    """Best achievable hit rate for the requests actually sent, and how it was tokenized.

    With the model's tokenizer and chat template (what the engines hash), exact to the token;
    without it, estimated from the workload's words (one token each).
    """
    if model:
        try:
            tok = _tokenizer(model)
            prompts = [tok.encode(tok.apply_chat_template(r.payload_messages())) for r in requests]
            before = [tok.encode(tok.apply_chat_template(r.payload_messages())) for r in history]
            rate = ideal_prefix_hit_rate(prompts, block_size, before)
            return rate, f"{model} tokenizer, block size {block_size}"
        except Exception as exc:  # any tokenizer trouble falls back to the estimate
            print(
                f"kvgate bench: tokenizer for {model!r} unavailable ({exc}); estimating from words",
                file=sys.stderr,
            )
    rate = ideal_prefix_hit_rate(
        [r.nominal_words for r in requests], block_size, [r.nominal_words for r in history]
    )
    return rate, "word estimate"


@functools.cache
def _tokenizer(model: str) -> Tokenizer:
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer(model)


class _Progress:
    """A tqdm bar on stderr (quiet when stderr is not a terminal unless forced)."""

    def __init__(self, total: int | None, label: str, enabled: bool | None) -> None:
        from tqdm import tqdm

        # disable=None lets tqdm hide the bar when stderr is not a terminal.
        disable = True if enabled is False else (False if enabled else None)
        self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=disable)
        self.errors = 0

    def __call__(self, result: RequestResult) -> None:
        if not result.ok:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def measure(
    label: str,
    target: Target,
    workload: WorkloadSpec,
    load: LoadSpec,
    slo: Slo,
    metrics_urls: Sequence[str] = (),
    progress: bool | None = None,
) -> RunOutcome:
    """Run the load once against `target`; prefix hits come from the engines' counter deltas."""
    warmup, requests = planned_requests(workload, load)
    if warmup:
        warm_load = replace(load, num_requests=len(warmup), duration_s=None, warmup_requests=0)
        bar = _Progress(len(warmup), f"{label} warm-up", progress)
        try:
            asyncio.run(run_load(target, iter(warmup), warm_load, on_result=bar))
        finally:
            bar.close()
    before = asyncio.run(engine_metrics.snapshot(metrics_urls)) if metrics_urls else None
    bar = _Progress(load.num_requests, label, progress)
    try:
        results, duration = asyncio.run(run_load(target, iter(requests), load, on_result=bar))
    finally:
        bar.close()
    deltas: dict[str, float] = {}
    hit: float | None = None
    if before is not None:
        after = asyncio.run(engine_metrics.snapshot(metrics_urls))
        deltas = after.minus(before)
        hit = engine_metrics.hit_rate(deltas)
    summary = summarize(
        label, results, duration, slo, request_rate=load.request_rate, concurrency=load.concurrency
    )
    summary.prefix_hit_rate = hit
    if deltas.get(engine_metrics.KV_TRANSFERS) or deltas.get(engine_metrics.KV_TRANSFER_FALLBACKS):
        summary.kv_transfer_bytes = deltas[engine_metrics.KV_TRANSFER_RECEIVED_BYTES]
        summary.kv_transfers = int(deltas[engine_metrics.KV_TRANSFERS])
        summary.kv_transfer_fallbacks = int(deltas[engine_metrics.KV_TRANSFER_FALLBACKS])
        summary.kv_transfer_seconds = deltas[engine_metrics.KV_TRANSFER_SECONDS]
    if any(r.model for r in requests):
        summary.lora_loads = int(deltas.get(engine_metrics.LORA_LOADS, 0))
    return RunOutcome(label, results, summary, deltas, load)


def sent_requests(
    workload: WorkloadSpec, load: LoadSpec, results: Sequence[RequestResult]
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up requests, measured requests actually sent)."""
    sent = {r.index for r in results}
    warmup, planned = planned_requests(workload, load)
    return warmup, [r for r in planned if r.index in sent]

"""Reads the engines' Prometheus `/metrics` (vLLM names) to measure prefix-cache hits during a run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvgate.api.contracts import metrics as m
from kvgate.api.contracts import prometheus_text

# Counters summed over every label set of every engine.
COUNTERS = (
    m.PREFIX_CACHE_QUERIES_TOTAL,
    m.PREFIX_CACHE_HITS_TOTAL,
    m.PROMPT_TOKENS_TOTAL,
    m.GENERATION_TOKENS_TOTAL,
    m.NUM_PREEMPTIONS_TOTAL,
    "kvgate:lora_adapter_loads_total",  # LoRA adapters put into a slot (the cost LoRA routing saves)
)
LORA_LOADS = "kvgate:lora_adapter_loads_total"


# Prefill/decode hand-offs, counted once each (the consumer's side): KV bytes the decode engines
# received, hand-offs they ran, and those that fell back to a local prefill.
KV_TRANSFER_RECEIVED_BYTES = "kv_transfer_received_bytes"
KV_TRANSFERS = "kv_transfers"
KV_TRANSFER_FALLBACKS = "kv_transfer_fallbacks"
KV_TRANSFER_SECONDS = "kv_transfer_seconds"  # summed over hand-offs (prefill call + pull)
_LABELLED: dict[str, tuple[str, str]] = {
    KV_TRANSFER_RECEIVED_BYTES: ("kvgate:kv_transfer_bytes_total", 'direction="received"'),
    KV_TRANSFERS: ("kvgate:kv_transfer_requests_total", 'role="consumer"'),
    KV_TRANSFER_FALLBACKS: ("kvgate:kv_transfer_fallbacks_total", ""),
    KV_TRANSFER_SECONDS: ("kvgate:kv_transfer_seconds_sum", ""),
}


def labelled_sums(text: str) -> dict[str, float]:
    """The P/D transfer counters above, each summed over the samples that carry its label."""
    out = dict.fromkeys(_LABELLED, 0.0)
    for name, raw_labels, value in prometheus_text.samples(text, prefixes=("kvgate:kv_transfer_",)):
        for key, (wanted, label) in _LABELLED.items():
            if name == wanted and label in raw_labels:
                out[key] += value
    return out


def parse_samples(text: str) -> dict[str, float]:
    """Each sample name summed over its label sets (kvgate.api.contracts.prometheus_text)."""
    return prometheus_text.summed(text)


@dataclass(frozen=True)
class CounterSnapshot:
    values: dict[str, float]
    reachable: int  # how many engines answered

    def minus(self, before: CounterSnapshot) -> dict[str, float]:
        return {k: self.values.get(k, 0.0) - before.values.get(k, 0.0) for k in (*COUNTERS, *_LABELLED)}


async def snapshot(metrics_urls: Sequence[str], timeout_s: float = 5.0) -> CounterSnapshot:
    """Sum the prefix-cache (and token) counters over all engines; unreachable ones count zero."""

    async def one(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
        try:
            resp = await client.get(url)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return parse_samples(resp.text) | labelled_sums(resp.text)

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        per_engine = await asyncio.gather(*(one(client, u) for u in metrics_urls))
    total = dict.fromkeys((*COUNTERS, *_LABELLED), 0.0)
    reachable = 0
    for samples in per_engine:
        if samples is None:
            continue
        reachable += 1
        for name in total:
            total[name] += samples.get(name, 0.0)
    return CounterSnapshot(total, reachable)


def hit_rate(delta: dict[str, float]) -> float | None:
    queries = delta.get(m.PREFIX_CACHE_QUERIES_TOTAL, 0.0)
    if queries <= 0:
        return None
    return delta.get(m.PREFIX_CACHE_HITS_TOTAL, 0.0) / queries

"""Reads the engines' Prometheus `/metrics` (vLLM names) to measure prefix-cache hits during a run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvgate.api.contracts import metrics as m

# Counters summed over every label set of every engine.
COUNTERS = (
    m.PREFIX_CACHE_QUERIES_TOTAL,
    m.PREFIX_CACHE_HITS_TOTAL,
    m.PROMPT_TOKENS_TOTAL,
    m.GENERATION_TOKENS_TOTAL,
    m.NUM_PREEMPTIONS_TOTAL,
)


def parse_samples(text: str) -> dict[str, float]:
    """Sum each sample name over its label sets in Prometheus text exposition format.

    Deliberately small: the names we read are plain counters and gauges, one sample per line
    (`name{labels} value [timestamp]`); comments and malformed lines are skipped.
    """
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        sums[name.strip()] = sums.get(name.strip(), 0.0) + value
    return sums


@dataclass(frozen=True)
class CounterSnapshot:
    values: dict[str, float]
    reachable: int  # how many engines answered

    def minus(self, before: CounterSnapshot) -> dict[str, float]:
        return {k: self.values.get(k, 0.0) - before.values.get(k, 0.0) for k in COUNTERS}


async def snapshot(metrics_urls: Sequence[str], timeout_s: float = 5.0) -> CounterSnapshot:
    """Sum the prefix-cache (and token) counters over all engines; unreachable ones count zero."""

    async def one(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
        try:
            resp = await client.get(url)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return parse_samples(resp.text)

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        per_engine = await asyncio.gather(*(one(client, u) for u in metrics_urls))
    total = dict.fromkeys(COUNTERS, 0.0)
    reachable = 0
    for samples in per_engine:
        if samples is None:
            continue
        reachable += 1
        for name in COUNTERS:
            total[name] += samples.get(name, 0.0)
    return CounterSnapshot(total, reachable)


def hit_rate(delta: dict[str, float]) -> float | None:
    queries = delta.get(m.PREFIX_CACHE_QUERIES_TOTAL, 0.0)
    if queries <= 0:
        return None
    return delta.get(m.PREFIX_CACHE_HITS_TOTAL, 0.0) / queries

"""Statistics over per-request results: latency percentiles, throughput, goodput under an SLO,
and the best prefix-cache hit rate a workload allows."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What the load generator observed for one request (times in seconds, monotonic clock)."""

    index: int
    group: str
    sent_at: float  # seconds since the run started
    status: int | None = None  # HTTP status; None when the connection itself failed
    ttft: float | None = None  # first content token
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    e2e: float | None = None  # only for requests that completed successfully
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if the server says
    output_tokens: int = 0
    error: str | None = None
    started_streaming: bool = False
    upstream: str | None = None  # the engine that answered, when the gateway says (x-kvgate-upstream)

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """A request is 'good' when it succeeded, its TTFT ≤ ttft_s and its mean ITL (TPOT) ≤ itl_s."""

    ttft_s: float = 0.5
    itl_s: float = 0.05

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.itl_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class Summary:
    """One line of a report: what a strategy (or a rate) achieved on the workload."""

    strategy: str
    requests: int
    completed: int
    errors: int
    duration_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    output_tok_s: float
    request_s: float
    goodput_req_s: float
    goodput_frac: float
    slo_ttft_s: float
    slo_itl_s: float
    prefix_hit_rate: float | None = None  # measured from the engines' counters
    ideal_prefix_hit_rate: float | None = None
    request_rate: float | None = None  # the offered Poisson rate, if any
    concurrency: int | None = None
    status_counts: dict[str, int] = field(default_factory=dict)
    # Prefill/decode runs: KV bytes the decode engines pulled, hand-offs, local-prefill fallbacks
    # (from the engines' kvgate:kv_transfer_* counters; None where no engine ran a hand-off).
    kv_transfer_bytes: float | None = None
    kv_transfers: int | None = None
    kv_transfer_fallbacks: int | None = None
    kv_transfer_seconds: float | None = None  # summed over the hand-offs
    # LoRA runs: adapters the engines put into a slot (each a weight load); None: no adapter ran
    lora_loads: int | None = None

    def as_record(self) -> dict[str, object]:
        return dict(self.__dict__)


def summarize(
    strategy: str,
    results: Sequence[RequestResult],
    duration_s: float,
    slo: Slo,
    *,
    request_rate: float | None = None,
    concurrency: int | None = None,
) -> Summary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in results if slo.met_by(r))
    counts: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status is not None else "conn-error"
        counts[key] = counts.get(key, 0) + 1
    span = max(duration_s, 1e-9)
    return Summary(
        strategy=strategy,
        requests=len(results),
        completed=len(ok),
        errors=len(results) - len(ok),
        duration_s=duration_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=mean(ttfts),
        itl_p50_s=percentile(itls, 50),
        itl_p90_s=percentile(itls, 90),
        itl_p99_s=percentile(itls, 99),
        tpot_p50_s=percentile(tpots, 50),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p90_s=percentile(e2es, 90),
        e2e_p99_s=percentile(e2es, 99),
        output_tok_s=out_tokens / span,
        request_s=len(ok) / span,
        goodput_req_s=good / span,
        goodput_frac=good / len(results) if results else 0.0,
        slo_ttft_s=slo.ttft_s,
        slo_itl_s=slo.itl_s,
        request_rate=request_rate,
        concurrency=concurrency,
        status_counts=counts,
    )


def ideal_prefix_hit_rate(
    prompts: Iterable[Sequence[Hashable]], block_size: int, history: Iterable[Sequence[Hashable]] = ()
) -> float | None:
    """The best prefix-cache hit rate any router can reach on these prompts, in tokens.

    A prompt's full blocks are cached as a hash chain; a block can only hit if a previous prompt
    computed the same chain up to it. The best any router can do is send every prompt to an
    engine that already holds its whole shared prefix, which (with enough KV) is the same as all
    prompts sharing one cache: each distinct chain block is computed once, every repeat is a
    hit. So ideal = Σ reused full-block tokens / Σ prompt tokens. For the shared-prefix workload
    this is 1 − (unique prefix tokens + all suffix tokens) / total prompt tokens, to block
    granularity. Like vLLM, at least the prompt's last token is always computed, so a prompt
    never hits in its final block when its length is an exact multiple of the block size.
    `history`: prompts sent before the measured ones (a warm-up); they fill the cache, uncounted.
    """
    if block_size < 1:
        raise ValueError("block size must be at least 1")
    seen: set[int] = set()
    for prompt in history:
        chain = 0
        tokens = list(prompt)
        for b in range(len(tokens) // block_size):
            chain = hash((chain, tuple(tokens[b * block_size : (b + 1) * block_size])))
            seen.add(chain)
    total = 0
    hits = 0
    for prompt in prompts:
        tokens = list(prompt)
        total += len(tokens)
        usable_blocks = (len(tokens) - 1) // block_size if tokens else 0
        chain = 0
        hit_run = True  # a hit only counts while every earlier block of the chain hit too
        for b in range(len(tokens) // block_size):
            chain = hash((chain, tuple(tokens[b * block_size : (b + 1) * block_size])))
            if hit_run and chain in seen and b < usable_blocks:
                hits += block_size
            else:
                hit_run = False
            seen.add(chain)
    if total == 0:
        return None
    return hits / total


def window_tokens(results: Sequence[RequestResult], start: float, end: float) -> int:
    """Output chunks (one token each from the engines) that reached the client in [start, end),
    seconds since the run started; failed requests' tokens count too (they were produced)."""
    return sum(1 for r in results for t in r.token_times if start <= r.sent_at + t < end)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    return a / b if a is not None and b else None

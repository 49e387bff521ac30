"""vLLM's Prometheus metrics, same names, types and labels, in a registry of our own.

Counters that the engine keeps as running totals (tokens, prefix-cache queries/hits,
preemptions) are advanced by the difference between successive engine snapshots; the
latency histograms and the per-reason success counter are fed per request by the server.
All writes happen on the engine thread; prometheus_client's own locks make scrapes safe.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvgate.api import metrics as names

# vLLM V1's buckets, so dashboards and SLO queries written for vLLM read the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class StatsSnapshot:
    """What the metrics need from `LLMEngine.get_stats()`, read once per engine step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0

    @classmethod
    def from_engine_stats(cls, stats: object) -> StatsSnapshot:
        def pick(*keys: str, default: float = 0) -> float:
            for key in keys:
                value = getattr(stats, key, None)
                if value is not None:
                    return value
            return default

        return cls(
            num_running=int(pick("num_running")),
            num_waiting=int(pick("num_waiting")),
            kv_cache_usage=float(pick("kv_cache_usage")),
            prompt_tokens_total=int(pick("prompt_tokens_total", "num_prompt_tokens_total", "prompt_tokens")),
            generation_tokens_total=int(
                pick("generation_tokens_total", "num_generation_tokens_total", "generation_tokens")
            ),
            prefix_cache_queries_total=int(pick("prefix_cache_queries_total")),
            prefix_cache_hits_total=int(pick("prefix_cache_hits_total")),
            num_preemptions_total=int(pick("num_preemptions_total")),
        )


@dataclass(frozen=True)
class CacheConfigInfo:
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"

    def labels(self) -> dict[str, str]:
        # vLLM renders these with str(): booleans as True/False, absent values as None.
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
        }


class EngineMetrics:
    def __init__(self, model_name: str, cache: CacheConfigInfo, engine_index: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        base = [names.LABEL_MODEL_NAME, names.LABEL_ENGINE]
        values = {names.LABEL_MODEL_NAME: model_name, names.LABEL_ENGINE: engine_index}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, base, registry=r).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, base, registry=r).labels(**values)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=tuple(buckets), registry=r).labels(**values)

        self.running = gauge(names.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.")
        self.waiting = gauge(names.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.")
        self.kv_usage = gauge(names.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_usage = gauge(
            names.GPU_CACHE_USAGE_PERC, "GPU KV-cache usage. 1 means 100 percent usage (deprecated alias)."
        )
        self.prompt_tokens = counter(names.PROMPT_TOKENS_TOTAL, "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            names.GENERATION_TOKENS_TOTAL, "Number of generation tokens processed."
        )
        self.prefix_queries = counter(
            names.PREFIX_CACHE_QUERIES_TOTAL, "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            names.PREFIX_CACHE_HITS_TOTAL, "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(names.NUM_PREEMPTIONS_TOTAL, "Cumulative number of preemptions.")
        success = Counter(
            names.REQUEST_SUCCESS_TOTAL,
            "Count of successfully processed requests.",
            [*base, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(**values, finished_reason=reason) for reason in FINISH_REASONS}
        self.ttft = histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        info = Gauge(
            names.CACHE_CONFIG_INFO,
            "Information of the LLMEngine CacheConfig",
            [*cache.labels(), "engine"],
            registry=r,
        )
        info.labels(**cache.labels(), engine=engine_index).set(1)
        self._lora = Gauge(
            names.LORA_REQUESTS_INFO,
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self.set_lora_state(max_lora=0, running=(), waiting=())
        self._last = StatsSnapshot()

    def set_lora_state(self, max_lora: int, running: Iterable[str], waiting: Iterable[str]) -> None:
        """Like vLLM: one series, value = time of the last change, adapters comma-separated."""
        labels = (str(max_lora), ",".join(sorted(waiting)), ",".join(sorted(running)))
        if labels == self._lora_labels:
            return
        if self._lora_labels is not None:
            self._lora.remove(*self._lora_labels)
        self._lora.labels(*labels).set(time.time())
        self._lora_labels = labels

    def update(self, snap: StatsSnapshot) -> None:
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv_cache_usage)
        self.gpu_usage.set(snap.kv_cache_usage)
        last = self._last
        for counter, new, old in (
            (self.prompt_tokens, snap.prompt_tokens_total, last.prompt_tokens_total),
            (self.generation_tokens, snap.generation_tokens_total, last.generation_tokens_total),
            (self.prefix_queries, snap.prefix_cache_queries_total, last.prefix_cache_queries_total),
            (self.prefix_hits, snap.prefix_cache_hits_total, last.prefix_cache_hits_total),
            (self.preemptions, snap.num_preemptions_total, last.num_preemptions_total),
        ):
            if new > old:
                counter.inc(new - old)
        self._last = snap

    def request_finished(self, reason: str | None) -> None:
        counter = self.success.get(reason or "stop")
        if counter is not None:
            counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

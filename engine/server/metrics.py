"""vLLM's Prometheus metrics: same names, types, labels and buckets, in a registry of our own.

The exposition is rendered here rather than by prometheus_client: an EPP scrapes every engine
about 20 times a second, and prometheus_client's generic renderer took ~3.7 ms for these ~100
samples (8 engines on 2 cores would spend most of a core on scrapes). Precomputed series
prefixes make a render ~30x cheaper, and an unchanged registry returns its cached bytes. The
output is Prometheus text format 0.0.4, checked against prometheus_client's parser in tests.

Writes come from the engine thread (per step), renders from the event loop; one lock keeps a
render from seeing half a step (e.g. a histogram count without its bucket).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvgate.api.contracts import metrics as names
from kvgate.engine.block_pool import HASH_ALGO

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


class _Metric:
    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name = name
        self.header = f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"

    def lines(self) -> Iterable[str]:
        raise NotImplementedError


class Scalar(_Metric):
    """A gauge or counter family: one value per label set."""

    def __init__(self, name: str, kind: str, doc: str) -> None:
        super().__init__(name, kind, doc)
        self.series: dict[str, float] = {}

    def child(self, labels: Mapping[str, str]) -> _Child:
        key = f"{self.name}{_labels(labels)} "
        self.series.setdefault(key, 0.0)
        return _Child(self.series, key)

    def remove(self, labels: Mapping[str, str]) -> None:
        self.series.pop(f"{self.name}{_labels(labels)} ", None)

    def lines(self) -> Iterable[str]:
        for prefix, value in self.series.items():
            yield prefix + _num(value) + "\n"


class _Child:
    __slots__ = ("_key", "_series")

    def __init__(self, series: dict[str, float], key: str) -> None:
        self._series = series
        self._key = key

    def set(self, value: float) -> None:
        self._series[self._key] = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self._series[self._key] += amount

    @property
    def value(self) -> float:
        return self._series[self._key]


class Histogram(_Metric):
    def __init__(self, name: str, doc: str, labels: Mapping[str, str], buckets: tuple[float, ...]) -> None:
        super().__init__(name, "histogram", doc)
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        sep = "," if inner else ""
        self._bucket_prefixes = [
            f'{name}_bucket{{{inner}{sep}le="{_num(b)}"}} ' for b in (*buckets, float("inf"))
        ]
        self._sum_prefix = f"{name}_sum{_labels(labels)} "
        self._count_prefix = f"{name}_count{_labels(labels)} "

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> Iterable[str]:
        cumulative = 0
        for prefix, n in zip(self._bucket_prefixes, self.counts, strict=True):
            cumulative += n
            yield f"{prefix}{cumulative}.0\n"
        yield f"{self._count_prefix}{self.count}.0\n"
        yield f"{self._sum_prefix}{_num(self.sum)}\n"


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
    prefill_tokens_pending: int = 0

    @classmethod
    def from_engine_stats(cls, stats: object) -> StatsSnapshot:
        return cls(
            num_running=int(getattr(stats, "num_running", 0)),
            num_waiting=int(getattr(stats, "num_waiting", 0)),
            kv_cache_usage=float(getattr(stats, "kv_cache_usage", 0.0)),
            prompt_tokens_total=int(getattr(stats, "prompt_tokens_total", 0)),
            generation_tokens_total=int(getattr(stats, "generation_tokens_total", 0)),
            prefix_cache_queries_total=int(getattr(stats, "prefix_cache_queries_total", 0)),
            prefix_cache_hits_total=int(getattr(stats, "prefix_cache_hits_total", 0)),
            num_preemptions_total=int(getattr(stats, "num_preemptions_total", 0)),
            prefill_tokens_pending=int(getattr(stats, "prefill_tokens_pending", 0)),
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
            "prefix_caching_hash_algo": HASH_ALGO,  # what the prefix cache really hashes with
            "sliding_window": "None",
        }


class EngineMetrics:
    def __init__(self, model_name: str, cache: CacheConfigInfo, engine_index: str = "0") -> None:
        self.lock = threading.Lock()
        base = {names.LABEL_MODEL_NAME: model_name, names.LABEL_ENGINE: engine_index}
        self._families: list[_Metric] = []

        def scalar(name: str, kind: str, doc: str) -> _Child:
            family = Scalar(name, kind, doc)
            self._families.append(family)
            return family.child(base)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, base, buckets)
            self._families.append(family)
            return family

        self.running = scalar(
            names.NUM_REQUESTS_RUNNING, "gauge", "Number of requests in model execution batches."
        )
        self.waiting = scalar(
            names.NUM_REQUESTS_WAITING, "gauge", "Number of requests waiting to be processed."
        )
        self.kv_usage = scalar(
            names.KV_CACHE_USAGE_PERC, "gauge", "KV-cache usage. 1 means 100 percent usage."
        )
        self.gpu_usage = scalar(
            names.GPU_CACHE_USAGE_PERC,
            "gauge",
            "GPU KV-cache usage. 1 means 100 percent usage (deprecated alias).",
        )
        self.prompt_tokens = scalar(
            names.PROMPT_TOKENS_TOTAL, "counter", "Number of prefill tokens processed."
        )
        self.generation_tokens = scalar(
            names.GENERATION_TOKENS_TOTAL, "counter", "Number of generation tokens processed."
        )
        self.prefix_queries = scalar(
            names.PREFIX_CACHE_QUERIES_TOTAL,
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = scalar(
            names.PREFIX_CACHE_HITS_TOTAL,
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.preemptions = scalar(names.NUM_PREEMPTIONS_TOTAL, "counter", "Cumulative number of preemptions.")
        success = Scalar(names.REQUEST_SUCCESS_TOTAL, "counter", "Count of successfully processed requests.")
        self._families.append(success)
        self.success = {r: success.child({**base, "finished_reason": r}) for r in FINISH_REASONS}
        self.ttft = histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        # vLLM's info gauges carry no model_name: the cache config plus the engine index.
        info = Scalar(names.CACHE_CONFIG_INFO, "gauge", "Information of the LLMEngine CacheConfig")
        self._families.append(info)
        info.child({**cache.labels(), "engine": engine_index}).set(1)
        # kvgate's own: 1 from SIGTERM on, while the engine still serves its grace period
        self.draining = scalar(
            names.KVGATE_DRAINING,
            "gauge",
            "1 while the server is shutting down: route new requests elsewhere.",
        )
        # kvgate's own: the prefill work ahead of a new request (a router's latency estimate)
        self.prefill_pending = scalar(
            names.KVGATE_PREFILL_TOKENS_PENDING,
            "gauge",
            "Prompt tokens still to compute, queued and running (prefix-cache hits excluded).",
        )
        self._lora = Scalar(names.LORA_REQUESTS_INFO, "gauge", "Running stats on lora requests.")
        self._families.append(self._lora)
        self._lora_labels: dict[str, str] | None = None
        self._last = StatsSnapshot()
        self._version = 0
        self._rendered: tuple[int, bytes] | None = None
        self.set_lora_state(max_lora=0, running=(), waiting=())

    def set_lora_state(self, max_lora: int, running: Iterable[str], waiting: Iterable[str]) -> None:
        """Like vLLM: one series, value = time of the last change, adapters comma-separated."""
        labels = {
            "max_lora": str(max_lora),
            "waiting_lora_adapters": ",".join(sorted(waiting)),
            "running_lora_adapters": ",".join(sorted(running)),
        }
        if labels == self._lora_labels:
            return
        with self.lock:
            if self._lora_labels is not None:
                self._lora.remove(self._lora_labels)
            self._lora.child(labels).set(time.time())
            self._lora_labels = labels
            self._version += 1

    def update(self, snap: StatsSnapshot) -> None:
        """Engine thread, once per step (caller holds `lock`)."""
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv_cache_usage)
        self.gpu_usage.set(snap.kv_cache_usage)
        self.prefill_pending.set(snap.prefill_tokens_pending)
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
        if snap != last:
            self._version += 1
        self._last = snap

    def note_submitted(self, requests: int, prompt_tokens: int) -> None:
        """Requests the server accepted that the engine thread has not taken in yet (it does so
        between steps, and a step can take most of a second): counted as waiting now, so a
        router scraping meanwhile sees them. Caller holds `lock`. The next `update` replaces
        these estimates with the engine's own counts."""
        self.waiting.set(self.waiting.value + requests)
        self.prefill_pending.set(self.prefill_pending.value + prompt_tokens)
        self._version += 1

    def set_draining(self, draining: bool) -> None:
        with self.lock:
            self.draining.set(1.0 if draining else 0.0)
            self._version += 1

    def request_finished(self, reason: str | None) -> None:
        """Engine thread (caller holds `lock`)."""
        counter = self.success.get(reason or "stop")
        if counter is not None:
            counter.inc()
        self._version += 1

    def touch(self) -> None:
        """Something changed outside `update` (a histogram observation); caller holds `lock`."""
        self._version += 1

    def render(self) -> bytes:
        with self.lock:
            cached = self._rendered
            if cached is not None and cached[0] == self._version:
                return cached[1]
            parts: list[str] = []
            for family in self._families:
                parts.append(family.header)
                parts.extend(family.lines())
            body = "".join(parts).encode()
            self._rendered = (self._version, body)
            return body

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
from typing import TypeVar

from kvgate.api.contracts import metrics as names
from kvgate.engine.core.block_pool import HASH_ALGO

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
# vLLM's request_latency_buckets: e2e and the per-phase histograms share them.
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's FinishReason strings: every series exists from the start. kvgate's engine ends requests
# with stop, length or abort; error and repetition stay 0 (no per-request error finish, no
# repetition detector), as on a vLLM that never hits them.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` (max_model_len)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished engine request, in the quantities vLLM's per-request histograms take."""

    queue_time: float  # arrival at the server -> first scheduled
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    inference_time: float  # first scheduled -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens_param: int | None

    @property
    def mean_time_per_output_token(self) -> float:
        # vLLM: decode time over the tokens after the first; 0 for a single-token request
        return self.decode_time / (self.num_generation_tokens - 1) if self.num_generation_tokens > 1 else 0.0


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
    sheddable_running: int = 0
    sheddable_waiting: int = 0
    sheddable_prefill_tokens_pending: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    lora_loads_total: int = 0
    host_kv_usage: float = 0.0
    host_cache_queries_total: int = 0
    host_cache_hits_total: int = 0
    host_kv_stores_total: int = 0
    host_kv_loads_total: int = 0
    host_kv_copy_seconds_total: float = 0.0
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos_total: tuple[int, ...] = ()

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
            sheddable_running=int(getattr(stats, "sheddable_running", 0)),
            sheddable_waiting=int(getattr(stats, "sheddable_waiting", 0)),
            sheddable_prefill_tokens_pending=int(getattr(stats, "sheddable_prefill_tokens_pending", 0)),
            running_loras=tuple(getattr(stats, "running_loras", ())),
            waiting_loras=tuple(getattr(stats, "waiting_loras", ())),
            lora_loads_total=int(getattr(stats, "lora_loads_total", 0)),
            host_kv_usage=float(getattr(stats, "host_kv_usage", 0.0)),
            host_cache_queries_total=int(getattr(stats, "host_cache_queries_total", 0)),
            host_cache_hits_total=int(getattr(stats, "host_cache_hits_total", 0)),
            host_kv_stores_total=int(getattr(stats, "host_kv_stores_total", 0)),
            host_kv_loads_total=int(getattr(stats, "host_kv_loads_total", 0)),
            host_kv_copy_seconds_total=float(getattr(stats, "host_kv_copy_seconds_total", 0.0)),
            spec_num_drafts_total=int(getattr(stats, "spec_num_drafts_total", 0)),
            spec_num_draft_tokens_total=int(getattr(stats, "spec_num_draft_tokens_total", 0)),
            spec_num_accepted_tokens_total=int(getattr(stats, "spec_num_accepted_tokens_total", 0)),
            spec_accepted_per_pos_total=tuple(getattr(stats, "spec_accepted_per_pos_total", ())),
        )


@dataclass(frozen=True)
class CacheConfigInfo:
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"
    num_cpu_blocks: int | None = None  # the host KV tier's blocks (--kv-offloading-size)

    def labels(self) -> dict[str, str]:
        # vLLM renders these with str(): booleans as True/False, absent values as None.
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "num_cpu_blocks": str(self.num_cpu_blocks),
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": HASH_ALGO,  # what the prefix cache really hashes with
            "sliding_window": "None",
        }


_M = TypeVar("_M", bound=_Metric)

# A plain series: one family labelled only by model name and engine, kept in an attribute of
# `EngineMetrics`: (attribute, name, kind, help). Attribute None: exported, never set.
_Series = tuple[str | None, str, str, str]

# The scheduler's state and vLLM's cumulative token counts.
_STEP_SERIES: tuple[_Series, ...] = (
    ("running", names.NUM_REQUESTS_RUNNING, "gauge", "Number of requests in model execution batches."),
    ("waiting", names.NUM_REQUESTS_WAITING, "gauge", "Number of requests waiting to be processed."),
    ("kv_usage", names.KV_CACHE_USAGE_PERC, "gauge", "KV-cache usage. 1 means 100 percent usage."),
    (
        "gpu_usage",
        names.GPU_CACHE_USAGE_PERC,
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage (deprecated alias).",
    ),
    ("prompt_tokens", names.PROMPT_TOKENS_TOTAL, "counter", "Number of prefill tokens processed."),
    ("generation_tokens", names.GENERATION_TOKENS_TOTAL, "counter", "Number of generation tokens processed."),
    (
        "prefix_queries",
        names.PREFIX_CACHE_QUERIES_TOTAL,
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "prefix_hits",
        names.PREFIX_CACHE_HITS_TOTAL,
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    ("preemptions", names.NUM_PREEMPTIONS_TOTAL, "counter", "Cumulative number of preemptions."),
)

# Where prompt tokens came from (after the by-source family). vLLM registers the external and
# multimodal ones whatever the config; a kvgate consumer (--kv-role) counts the prompt tokens it
# asked a producer for and those it pulled, and the host KV tier (--kv-offloading-size, a
# connector in vLLM) the tokens looked up in it and loaded from it; multimodal stays 0.
_PROMPT_SERIES: tuple[_Series, ...] = (
    (
        "prompt_cached",
        names.PROMPT_TOKENS_CACHED_TOTAL,
        "counter",
        "Number of cached prompt tokens (local + external).",
    ),
    (
        "prompt_recomputed",
        names.PROMPT_TOKENS_RECOMPUTED_TOTAL,
        "counter",
        "Number of cached tokens recomputed for forward pass.",
    ),
    (
        "external_queries",
        names.EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL,
        "counter",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
    ),
    (
        "external_hits",
        names.EXTERNAL_PREFIX_CACHE_HITS_TOTAL,
        "counter",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
    ),
    (
        None,
        names.MM_CACHE_QUERIES_TOTAL,
        "counter",
        "Multi-modal cache queries, in terms of number of queried items.",
    ),
    (
        None,
        names.MM_CACHE_HITS_TOTAL,
        "counter",
        "Multi-modal cache hits, in terms of number of cached items.",
    ),
)

# The host KV tier, LoRA slots and P/D pins (after the kv_transfer families).
_KV_SERIES: tuple[_Series, ...] = (
    (
        "host_kv_usage",
        names.CPU_CACHE_USAGE_PERC,
        "gauge",
        "CPU KV-cache usage. 1 means 100 percent usage (the host tier, --kv-offloading-size).",
    ),
    ("host_kv_stores", names.KVGATE_KV_OFFLOAD_STORES_TOTAL, "counter", "KV blocks copied to the host tier."),
    (
        "host_kv_loads",
        names.KVGATE_KV_OFFLOAD_LOADS_TOTAL,
        "counter",
        "KV blocks loaded back from the host tier instead of computed again.",
    ),
    (
        "host_kv_copy_seconds",
        names.KVGATE_KV_OFFLOAD_SECONDS_TOTAL,
        "counter",
        "Seconds steps spent copying KV blocks between the device and the host tier.",
    ),
    (
        "lora_loads",
        "kvgate:lora_adapter_loads_total",
        "counter",
        "LoRA adapters put into a device slot (each costs a weight copy; LoRA-aware routing avoids them).",
    ),
    (
        "kv_transfer_pinned",
        "kvgate:kv_transfer_pinned_blocks",
        "gauge",
        "KV blocks a producer holds for pulls not made yet.",
    ),
)

# kvgate's own gauges for routers (after the cache config info).
_ROUTING_SERIES: tuple[_Series, ...] = (
    # 1 from SIGTERM on, while the engine still serves its grace period
    (
        "draining",
        names.KVGATE_DRAINING,
        "gauge",
        "1 while the server is shutting down: route new requests elsewhere.",
    ),
    # the prefill work ahead of a new request (a router's latency estimate)
    (
        "prefill_pending",
        names.KVGATE_PREFILL_TOKENS_PENDING,
        "gauge",
        "Prompt tokens still to compute, queued and running (prefix-cache hits excluded).",
    ),
    # the sheddable part of the three above: work the engine preempts for an online arrival
    (
        "sheddable_running",
        names.KVGATE_NUM_REQUESTS_RUNNING_SHEDDABLE,
        "gauge",
        "Running requests of a priority below the default (sheddable), preempted for a waiting default-priority one.",
    ),
    (
        "sheddable_waiting",
        names.KVGATE_NUM_REQUESTS_WAITING_SHEDDABLE,
        "gauge",
        "Waiting requests of a priority below the default (sheddable).",
    ),
    (
        "sheddable_prefill_pending",
        names.KVGATE_PREFILL_TOKENS_PENDING_SHEDDABLE,
        "gauge",
        "Prompt tokens still to compute of requests of a priority below the default (sheddable).",
    ),
    # constant: the batch slots, so a router can tell a request that runs at once from one that waits
    (
        "max_num_seqs",
        names.KVGATE_MAX_NUM_SEQS,
        "gauge",
        "Most sequences the engine runs in one step (--max-num-seqs).",
    ),
)

# vLLM's per-request histograms, labelled by model name and engine: (attribute, name, help,
# buckets); buckets None: 1-2-5 steps up to the context length (token counts).
_HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...] | None], ...] = (
    ("ttft", names.TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", names.INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("e2e", names.E2E_REQUEST_LATENCY_SECONDS, "Histogram of e2e request latency in seconds.", E2E_BUCKETS),
    (
        "tpot",
        names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS,
    ),
    (
        "queue_time",
        names.REQUEST_QUEUE_TIME_SECONDS,
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "inference_time",
        names.REQUEST_INFERENCE_TIME_SECONDS,
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "prefill_time",
        names.REQUEST_PREFILL_TIME_SECONDS,
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "decode_time",
        names.REQUEST_DECODE_TIME_SECONDS,
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    ("request_prompt_tokens", names.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed.", None),
    (
        "request_generation_tokens",
        names.REQUEST_GENERATION_TOKENS,
        "Number of generation tokens processed.",
        None,
    ),
    (
        "prefill_kv_computed",
        names.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        None,
    ),
    (
        "iteration_tokens",
        names.ITERATION_TOKENS_TOTAL,
        "Histogram of number of tokens per engine_step.",
        tuple(float(b) for b in ITERATION_TOKENS_BUCKETS),
    ),
    (
        "max_num_generation_tokens",
        names.REQUEST_MAX_NUM_GENERATION_TOKENS,
        "Histogram of maximum number of requested generation tokens.",
        None,
    ),
    (
        "params_n",
        names.REQUEST_PARAMS_N,
        "Histogram of the n request parameter.",
        tuple(float(b) for b in PARAMS_N_BUCKETS),
    ),
    (
        "params_max_tokens",
        names.REQUEST_PARAMS_MAX_TOKENS,
        "Histogram of the max_tokens request parameter.",
        None,
    ),
)


class EngineMetrics:
    # Set from the tables above (the plain series and the per-request histograms).
    running: _Child
    waiting: _Child
    kv_usage: _Child
    gpu_usage: _Child
    prompt_tokens: _Child
    generation_tokens: _Child
    prefix_queries: _Child
    prefix_hits: _Child
    preemptions: _Child
    prompt_cached: _Child
    prompt_recomputed: _Child
    external_queries: _Child
    external_hits: _Child
    host_kv_usage: _Child
    host_kv_stores: _Child
    host_kv_loads: _Child
    host_kv_copy_seconds: _Child
    lora_loads: _Child
    kv_transfer_pinned: _Child
    draining: _Child
    prefill_pending: _Child
    sheddable_running: _Child
    sheddable_waiting: _Child
    sheddable_prefill_pending: _Child
    max_num_seqs: _Child
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    tpot: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    prefill_kv_computed: Histogram
    iteration_tokens: Histogram
    max_num_generation_tokens: Histogram
    params_n: Histogram
    params_max_tokens: Histogram

    def __init__(
        self,
        model_name: str,
        cache: CacheConfigInfo,
        engine_index: str = "0",
        max_model_len: int = 2048,
        num_speculative_tokens: int = 0,
        max_num_seqs: int = 0,
    ) -> None:
        self.lock = threading.Lock()
        base = {names.LABEL_MODEL_NAME: model_name, names.LABEL_ENGINE: engine_index}
        self._families: list[_Metric] = []

        def family(metric: _M) -> _M:
            self._families.append(metric)
            return metric

        def series(rows: tuple[_Series, ...]) -> None:
            for attribute, name, kind, doc in rows:
                child = family(Scalar(name, kind, doc)).child(base)
                if attribute is not None:
                    setattr(self, attribute, child)

        # Unlabelled by model and engine, as vLLM's instrumentator exports it.
        self.http_requests = family(
            Scalar(
                "http_requests_total", "counter", "Total number of requests by method, status and handler."
            )
        )
        series(_STEP_SERIES)
        by_source = family(
            Scalar(names.PROMPT_TOKENS_BY_SOURCE_TOTAL, "counter", "Number of prompt tokens by source.")
        )
        self.prompt_by_source = {
            src: by_source.child({**base, "source": src}) for src in PROMPT_TOKEN_SOURCES
        }
        series(_PROMPT_SERIES)
        # Prefill/decode disaggregation (kvgate's own; vLLM's connectors export theirs).
        self._kv_transfer_families = {
            "requests": Scalar(
                "kvgate:kv_transfer_requests_total",
                "counter",
                "Prefill/decode hand-offs: pins served as a producer, pulls tried as a consumer.",
            ),
            "bytes": Scalar(
                "kvgate:kv_transfer_bytes_total", "counter", "KV bytes moved by prefill/decode hand-offs."
            ),
            "fallbacks": Scalar(
                "kvgate:kv_transfer_fallbacks_total",
                "counter",
                "Hand-offs that did not happen (the consumer prefilled locally; a producer's pin expired).",
            ),
        }
        self._families.extend(self._kv_transfer_families.values())
        self._kv_transfer_base = base
        self.kv_transfer_seconds = family(
            Histogram(
                "kvgate:kv_transfer_seconds",
                "Consumer hand-off time: the prefill call and the pull.",
                base,
                (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            )
        )
        series(_KV_SERIES)
        sleep = family(
            Scalar(
                names.ENGINE_SLEEP_STATE,
                "gauge",
                "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            )
        )
        for state in SLEEP_STATES:  # kvgate has no sleep mode: always awake
            sleep.child({**base, "sleep_state": state}).set(1.0 if state == "awake" else 0.0)
        success = family(
            Scalar(names.REQUEST_SUCCESS_TOTAL, "counter", "Count of successfully processed requests.")
        )
        self.success = {r: success.child({**base, "finished_reason": r}) for r in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        for attribute, name, doc, buckets in _HISTOGRAMS:
            setattr(
                self,
                attribute,
                family(Histogram(name, doc, base, token_buckets if buckets is None else buckets)),
            )
        # vLLM's info gauges carry no model_name: the cache config plus the engine index.
        info = family(Scalar(names.CACHE_CONFIG_INFO, "gauge", "Information of the LLMEngine CacheConfig"))
        info.child({**cache.labels(), "engine": engine_index}).set(1)
        series(_ROUTING_SERIES)
        self.max_num_seqs.set(max_num_seqs)
        # vLLM's speculative decoding counters, only when it is on (as vLLM registers them)
        self._spec: list[_Child] = []
        self._spec_per_pos: list[_Child] = []
        if num_speculative_tokens:
            for name, doc in (
                (names.SPEC_DECODE_NUM_DRAFTS_TOTAL, "Number of spec decoding drafts."),
                (names.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, "Number of draft tokens."),
                (names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, "Number of accepted tokens."),
            ):
                self._spec.append(family(Scalar(name, "counter", doc)).child(base))
            per_pos = family(
                Scalar(
                    names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL,
                    "counter",
                    "Accepted tokens per draft position.",
                )
            )
            self._spec_per_pos = [
                per_pos.child({**base, "position": str(p)}) for p in range(num_speculative_tokens)
            ]
        self._lora = family(Scalar(names.LORA_REQUESTS_INFO, "gauge", "Running stats on lora requests."))
        self._lora_labels: dict[str, str] | None = None
        self._max_lora = 0  # --max-loras with --enable-lora; 0: LoRA off
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
            self._max_lora = max_lora
            self._set_lora_labels(labels)

    def _set_lora_labels(self, labels: dict[str, str]) -> None:
        if labels == self._lora_labels:
            return
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
        self.sheddable_running.set(snap.sheddable_running)
        self.sheddable_waiting.set(snap.sheddable_waiting)
        self.sheddable_prefill_pending.set(snap.sheddable_prefill_tokens_pending)
        self.host_kv_usage.set(snap.host_kv_usage)
        if self._max_lora:  # the engine's adapters with running / waiting requests, as vLLM
            self._set_lora_labels(
                {
                    "max_lora": str(self._max_lora),
                    "waiting_lora_adapters": ",".join(sorted(snap.waiting_loras)),
                    "running_lora_adapters": ",".join(sorted(snap.running_loras)),
                }
            )
        last = self._last
        for counter, new, old in (
            (self.prompt_tokens, snap.prompt_tokens_total, last.prompt_tokens_total),
            (self.generation_tokens, snap.generation_tokens_total, last.generation_tokens_total),
            (self.prefix_queries, snap.prefix_cache_queries_total, last.prefix_cache_queries_total),
            (self.prefix_hits, snap.prefix_cache_hits_total, last.prefix_cache_hits_total),
            (self.preemptions, snap.num_preemptions_total, last.num_preemptions_total),
            (self.lora_loads, snap.lora_loads_total, last.lora_loads_total),
            (self.external_queries, snap.host_cache_queries_total, last.host_cache_queries_total),
            (self.external_hits, snap.host_cache_hits_total, last.host_cache_hits_total),
            (self.host_kv_stores, snap.host_kv_stores_total, last.host_kv_stores_total),
            (self.host_kv_loads, snap.host_kv_loads_total, last.host_kv_loads_total),
            (self.host_kv_copy_seconds, snap.host_kv_copy_seconds_total, last.host_kv_copy_seconds_total),
        ):
            if new > old:
                counter.inc(new - old)
        if self._spec:
            for counter, new, old in zip(
                self._spec,
                (
                    snap.spec_num_drafts_total,
                    snap.spec_num_draft_tokens_total,
                    snap.spec_num_accepted_tokens_total,
                ),
                (
                    last.spec_num_drafts_total,
                    last.spec_num_draft_tokens_total,
                    last.spec_num_accepted_tokens_total,
                ),
                strict=True,
            ):
                if new > old:
                    counter.inc(new - old)
            before = last.spec_accepted_per_pos_total
            for pos, (counter, new) in enumerate(
                zip(self._spec_per_pos, snap.spec_accepted_per_pos_total, strict=False)
            ):
                old = before[pos] if pos < len(before) else 0
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

    def prompt_done(
        self,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_recomputed_tokens: int,
        num_host_cached_tokens: int = 0,
    ) -> None:
        """A request finished its prefill (first token): vLLM's prompt-token accounting (tokens
        loaded from the host tier come through vLLM's KV connector: `external_kv_transfer`).
        Engine thread (caller holds `lock`)."""
        cached = max(num_cached_tokens, 0)
        host = min(max(num_host_cached_tokens, 0), cached)
        self.prompt_by_source["local_compute"].inc(num_prompt_tokens - cached)
        self.prompt_by_source["local_cache_hit"].inc(cached - host)
        self.prompt_by_source["external_kv_transfer"].inc(host)
        self.prompt_cached.inc(cached)
        self.prompt_recomputed.inc(num_recomputed_tokens)

    def request_done(self, stats: FinishedRequestStats) -> None:
        """vLLM's per-request histograms for one finished request (caller holds `lock`)."""
        self.queue_time.observe(stats.queue_time)
        self.prefill_time.observe(stats.prefill_time)
        self.decode_time.observe(stats.decode_time)
        self.inference_time.observe(stats.inference_time)
        self.tpot.observe(stats.mean_time_per_output_token)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        self.prefill_kv_computed.observe(stats.num_prompt_tokens - max(stats.num_cached_tokens, 0))
        if stats.max_tokens_param:
            self.params_max_tokens.observe(stats.max_tokens_param)

    def parent_done(self, n: int, max_generation_tokens: int) -> None:
        """All `n` sequences of one prompt finished (vLLM's parent request); caller holds `lock`."""
        self.params_n.observe(n)
        self.max_num_generation_tokens.observe(max_generation_tokens)

    def kv_transfer(self, what: str, labels: Mapping[str, str]) -> _Child:
        """A kvgate:kv_transfer_* counter child ('requests', 'bytes', 'fallbacks')."""
        return self._kv_transfer_families[what].child({**self._kv_transfer_base, **labels})

    def note_http(self, handler: str, method: str, status: int) -> None:
        """One answered HTTP request, as vLLM's API server counts them (its FastAPI
        instrumentator): `http_requests_total{handler, method, status}`, status grouped as
        `2xx`..`5xx`. The error-rate alert and panel read it: the EPP never sees engine statuses."""
        child = self.http_requests.child(
            {"handler": handler, "method": method, "status": f"{status // 100}xx"}
        )
        with self.lock:
            child.inc()
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

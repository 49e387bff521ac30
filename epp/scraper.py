"""Scrapes each endpoint's Prometheus ``/metrics`` into the datastore every refresh interval.

Besides load, a scrape carries the engine's shutdown notice: ``kvgate:draining 1`` on /metrics
(kvgate engines) takes it out of the candidate set on the very scrape that sees it. Engines
without that gauge (vLLM) signal it by /health answering 503, probed every few scrapes.
Engines that require the API key on /metrics get ``Authorization: Bearer $KVGATE_API_KEY``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

from kvgate.api.contracts import metrics as vllm
from kvgate.api.contracts import prometheus_text
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.endpoint_tasks import EndpointTasks
from kvgate.epp.http_get import EndpointRefused, KeepAliveGetter, ScrapeError, get_request

log = logging.getLogger("kvgate.epp.scraper")


@dataclass(frozen=True)
class MetricSpec:
    """``name`` or ``name{label="value"}``: which series carries a signal."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        m = re.fullmatch(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{(.*)\})?\s*", text)
        if not m:
            raise ValueError(f"not a metric spec: {text!r} (use name or name{{label=value}})")
        labels = tuple(
            (k.strip(), v.strip().strip('"'))
            for k, v in (p.split("=", 1) for p in (m.group(2) or "").split(",") if p.strip())
        )
        return cls(m.group(1), labels)


@dataclass(frozen=True)
class MetricMapping:
    waiting: MetricSpec
    running: MetricSpec
    kv_usage: MetricSpec
    lora_info: MetricSpec | None = None


MAPPINGS: dict[str, MetricMapping] = {
    "vllm": MetricMapping(
        MetricSpec(vllm.NUM_REQUESTS_WAITING),
        MetricSpec(vllm.NUM_REQUESTS_RUNNING),
        MetricSpec(vllm.KV_CACHE_USAGE_PERC),
        MetricSpec(vllm.LORA_REQUESTS_INFO),
    ),
    "sglang": MetricMapping(
        MetricSpec("sglang:num_queue_reqs"),
        MetricSpec("sglang:num_running_reqs"),
        MetricSpec("sglang:token_usage"),
    ),
    "triton-tensorrt-llm": MetricMapping(
        MetricSpec("nv_trt_llm_request_metrics", (("request_type", "waiting"),)),
        MetricSpec("nv_trt_llm_request_metrics", (("request_type", "scheduled"),)),
        MetricSpec("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "fraction"),)),
    ),
}

# Counters the latency model learns each engine's speed from (summed over series).
_COUNTERS = (
    vllm.PROMPT_TOKENS_TOTAL,
    vllm.PREFIX_CACHE_HITS_TOTAL,
    vllm.EXTERNAL_PREFIX_CACHE_HITS_TOTAL,
    vllm.KVGATE_KV_OFFLOAD_SECONDS_TOTAL,
    vllm.KVGATE_KV_OFFLOAD_STORES_TOTAL,
    vllm.KVGATE_KV_OFFLOAD_LOADS_TOTAL,
    vllm.INTER_TOKEN_LATENCY_SECONDS + "_sum",
    vllm.INTER_TOKEN_LATENCY_SECONDS + "_count",
)

# vLLM's API server counts every answered request (its FastAPI instrumentator) and kvgate's engine
# likewise: http_requests_total{handler, method, status="2xx"}. A success on one of these two
# handlers is a change of the engine's adapter list, seen on the next 50 ms scrape.
_HTTP_REQUESTS = "http_requests_total"
_ADAPTER_HANDLERS = ('handler="/v1/load_lora_adapter"', 'handler="/v1/unload_lora_adapter"')


MAX_BATCH_SLOTS = 1 << 20  # no engine runs more sequences at once


_SHEDDABLE = (
    vllm.KVGATE_NUM_REQUESTS_WAITING_SHEDDABLE,
    vllm.KVGATE_NUM_REQUESTS_RUNNING_SHEDDABLE,
    vllm.KVGATE_PREFILL_TOKENS_PENDING_SHEDDABLE,
)
_MAX_COUNT = 1e12  # a forged +Inf or huge gauge is capped, never an OverflowError


def _count(counters: dict[str, float], name: str) -> int:
    return int(min(_MAX_COUNT, counters.get(name, 0.0)))


def _sum_present(counters: dict[str, float], *names: str) -> float | None:
    found = [counters[n] for n in names if n in counters]
    return sum(found) if found else None


def parse_metrics(text: str, mapping: MetricMapping, now: float, sent_at: float = 0.0) -> EndpointMetrics:
    """Reads only the series the mapping names; sums counts, takes the max of utilisation."""
    wanted = {
        mapping.waiting.name,
        mapping.running.name,
        mapping.kv_usage.name,
        vllm.KVGATE_DRAINING,
        vllm.KVGATE_PREFILL_TOKENS_PENDING,
        vllm.KVGATE_MAX_NUM_SEQS,
        *_SHEDDABLE,
        *_COUNTERS,
    }
    if mapping.lora_info:
        wanted.add(mapping.lora_info.name)
    waiting = running = 0.0
    kv = 0.0
    lora_ts = -1.0
    lora: dict[str, str] = {}
    found_kv = False
    draining = False
    prefill_pending: float | None = None
    max_num_seqs = 0.0
    counters: dict[str, float] = {}
    blocks_total: int | None = None
    host_blocks_total: int | None = None
    adapter_changes: float | None = None
    prefixes = (*wanted, vllm.CACHE_CONFIG_INFO, _HTTP_REQUESTS)
    for name, raw_labels, value in prometheus_text.samples(text, prefixes=prefixes):
        if name == vllm.CACHE_CONFIG_INFO:
            found = re.search(r'num_gpu_blocks="(\d+)"', raw_labels)
            blocks_total = int(found.group(1)) if found else blocks_total
            found = re.search(r'num_cpu_blocks="(\d+)"', raw_labels)
            host_blocks_total = int(found.group(1)) if found else host_blocks_total
            continue
        if name == _HTTP_REQUESTS:
            if any(h in raw_labels for h in _ADAPTER_HANDLERS) and 'status="2' in raw_labels:
                adapter_changes = (adapter_changes or 0.0) + value
            continue
        if name not in wanted:
            continue
        if name == vllm.KVGATE_DRAINING:
            draining = draining or value > 0
            continue
        if name == vllm.KVGATE_PREFILL_TOKENS_PENDING:
            prefill_pending = (prefill_pending or 0.0) + max(0.0, value)
            continue
        if name == vllm.KVGATE_MAX_NUM_SEQS:
            # one series per engine index: their slots add up; a forged huge or NaN value is capped
            max_num_seqs = min(float(MAX_BATCH_SLOTS), max_num_seqs + max(0.0, value))
            continue
        if name in _SHEDDABLE:  # one series per engine index: they add up
            counters[name] = counters.get(name, 0.0) + max(0.0, value)
            continue
        if name in _COUNTERS:
            counters[name] = counters.get(name, 0.0) + value
            continue
        labels = prometheus_text.labels(raw_labels)
        for spec, kind in ((mapping.waiting, "w"), (mapping.running, "r"), (mapping.kv_usage, "k")):
            if name == spec.name and all(labels.get(k) == v for k, v in spec.labels):
                if kind == "w":
                    waiting += value
                elif kind == "r":
                    running += value
                else:
                    kv = max(kv, value)
                    found_kv = True
        if mapping.lora_info and name == mapping.lora_info.name and value >= lora_ts:
            lora_ts, lora = value, labels
    if not found_kv and mapping.kv_usage.name == vllm.KV_CACHE_USAGE_PERC:
        # older vLLM exports only the deprecated alias
        return parse_metrics(
            text,
            MetricMapping(
                mapping.waiting, mapping.running, MetricSpec(vllm.GPU_CACHE_USAGE_PERC), mapping.lora_info
            ),
            now,
            sent_at,
        )

    def adapters(key: str) -> frozenset[str]:
        return frozenset(a for a in lora.get(key, "").split(",") if a)

    return EndpointMetrics(
        waiting=int(waiting),
        running=int(running),
        kv_usage=min(1.0, max(0.0, kv)),
        max_lora=int(lora.get("max_lora", "0") or 0),
        running_loras=adapters("running_lora_adapters"),
        waiting_loras=adapters("waiting_lora_adapters"),
        updated_at=now,
        draining=draining,
        sent_at=sent_at,
        prefill_tokens_pending=None if prefill_pending is None else int(prefill_pending),
        # (a forged value larger than the total only empties the view: without_sheddable clamps)
        sheddable_waiting=_count(counters, vllm.KVGATE_NUM_REQUESTS_WAITING_SHEDDABLE),
        sheddable_running=_count(counters, vllm.KVGATE_NUM_REQUESTS_RUNNING_SHEDDABLE),
        sheddable_prefill_tokens=_count(counters, vllm.KVGATE_PREFILL_TOKENS_PENDING_SHEDDABLE),
        kv_blocks_total=blocks_total,
        max_num_seqs=int(max_num_seqs),
        prompt_tokens_total=counters.get(vllm.PROMPT_TOKENS_TOTAL),
        prefix_hits_total=counters.get(vllm.PREFIX_CACHE_HITS_TOTAL),
        external_hits_total=counters.get(vllm.EXTERNAL_PREFIX_CACHE_HITS_TOTAL),
        host_kv_blocks_total=host_blocks_total,
        kv_copy_seconds_total=counters.get(vllm.KVGATE_KV_OFFLOAD_SECONDS_TOTAL),
        kv_blocks_copied_total=_sum_present(
            counters, vllm.KVGATE_KV_OFFLOAD_STORES_TOTAL, vllm.KVGATE_KV_OFFLOAD_LOADS_TOTAL
        ),
        itl_seconds_sum=counters.get(vllm.INTER_TOKEN_LATENCY_SECONDS + "_sum"),
        itl_count=counters.get(vllm.INTER_TOKEN_LATENCY_SECONDS + "_count"),
        adapter_changes=adapter_changes,
    )


MODELS_REFRESH_S = 10.0  # how often GET /v1/models is asked again (served names, context)
# ...and asked at once when a scrape shows the engine's adapters changed, but never more often
# than this: an engine loading adapters every scrape costs one GET per this interval.
MODELS_MIN_GAP_S = 0.5


class MetricsScraper:
    """One polling task per endpoint, started and stopped as discovery adds and removes them."""

    def __init__(
        self,
        datastore: Datastore,
        mapping: MetricMapping,
        interval: float = 0.05,
        timeout: float = 1.0,
        path: str = "/metrics",
        api_key: str | None = None,
        health_path: str | None = "/health",
        health_every: int = 4,
    ) -> None:
        self.datastore = datastore
        self.mapping = mapping
        self.interval = interval
        self.path = path
        self.timeout = timeout
        self.api_key = api_key
        self.health_path = health_path
        self.health_every = max(1, health_every)  # a /health probe every this many scrapes
        self._tasks = EndpointTasks("scrape")
        datastore.subscribe(self._on_endpoint)
        for state in datastore.all():
            self._on_endpoint(state.endpoint, True)

    def _on_endpoint(self, endpoint: Endpoint, added: bool) -> None:
        self._tasks.replace(endpoint.address, (lambda: self._poll(endpoint)) if added else None)

    def _request(self, host: str, port: int, path: str) -> bytes:
        return get_request(host, port, path, self.api_key)

    async def scrape_once(self, endpoint: Endpoint, getter: KeepAliveGetter) -> bool:
        raw = self._request(getter.host, getter.port, self.path)
        try:
            sent_at = time.monotonic()
            status, body = await getter.request(raw)
            if status != 200:
                if status in (401, 403):
                    log.warning(
                        "scrape %s: HTTP %d; set KVGATE_API_KEY to the engines' API key",
                        endpoint.address,
                        status,
                    )
                raise ScrapeError(f"HTTP {status}")
        except EndpointRefused:
            # nothing listens any more: take it out of rotation now, not after several misses
            state = self.datastore.get(endpoint.address)
            if state is not None:
                state.metrics.consecutive_failures = max(
                    state.metrics.consecutive_failures + 1, self.datastore.unreachable_after_failures
                )
            return False
        except ScrapeError as exc:
            log.debug("scrape %s failed: %s", endpoint.address, exc)
            self.datastore.scrape_failed(endpoint.address)
            return False
        text = body.decode("utf-8", "replace")
        self.datastore.update_metrics(
            endpoint.address, parse_metrics(text, self.mapping, time.monotonic(), sent_at)
        )
        return True

    async def probe_health(self, endpoint: Endpoint, getter: KeepAliveGetter) -> None:
        """503 from /health: the engine is shutting down or broken; not a candidate until 200."""
        if self.health_path is None:
            return
        try:
            status, _ = await getter.request(self._request(getter.host, getter.port, self.health_path))
        except ScrapeError:
            return  # the /metrics scrape tracks reachability
        state = self.datastore.get(endpoint.address)
        if state is None:
            return
        unavailable = status == 503
        if unavailable != state.health_unavailable:
            log.info("endpoint %s: /health %d", endpoint.address, status)
            state.health_unavailable = unavailable

    async def fetch_models(self, endpoint: Endpoint, getter: KeepAliveGetter) -> None:
        """What the endpoint serves (names, context length), from its OpenAI GET /v1/models.
        Best effort: an engine that refuses it simply reports nothing."""
        try:
            status, body = await getter.request(self._request(getter.host, getter.port, "/v1/models"))
            if status != 200:
                return
            data = json.loads(body)["data"]
            names = frozenset(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
            # vLLM lists a LoRA adapter with its base model as "parent"; the base has none.
            adapters = frozenset(
                str(m["id"]) for m in data if isinstance(m, dict) and "id" in m and m.get("parent")
            )
            lengths = [int(m["max_model_len"]) for m in data if isinstance(m, dict) and "max_model_len" in m]
        except (ScrapeError, ValueError, KeyError, TypeError):
            return
        state = self.datastore.get(endpoint.address)
        if state is not None:
            state.served_models = names
            state.served_adapters = adapters
            state.max_model_len = max(lengths, default=0)

    async def _poll(self, endpoint: Endpoint) -> None:
        host, _, port = endpoint.address.rpartition(":")
        getter = KeepAliveGetter(host.strip("[]"), int(port), self.path, self.timeout)
        models = KeepAliveGetter(host.strip("[]"), int(port), "/v1/models", self.timeout)
        # None until the first answer: an engine still loading its model is not news, and a
        # start-up that logs "unreachable" for every engine reads like a failure.
        was_ok: bool | None = None
        next_models = 0.0
        last_models = 0.0
        changes: float | None = None  # the engine's adapter load/unload count, last scrape
        loras: frozenset[str] = frozenset()  # adapters running or waiting there, last scrape
        stale = False  # the adapter list changed since the last GET /v1/models
        n = 0
        try:
            while True:
                ok = await self.scrape_once(endpoint, getter)
                n += 1
                if ok and n % self.health_every == 0:
                    await self.probe_health(endpoint, getter)
                if ok != was_ok:
                    if was_ok is None and not ok:
                        log.debug("endpoint %s not answering yet", endpoint.address)
                    else:
                        log.info("endpoint %s %s", endpoint.address, "reachable" if ok else "unreachable")
                    was_ok = ok
                state = self.datastore.get(endpoint.address) if ok else None
                if state is not None:
                    m = state.metrics
                    # a load/unload answered (its series appears with the first one), or an adapter
                    # with requests there its model list lacks (loaded another way: a vLLM resolver)
                    new_loras = m.running_loras | m.waiting_loras
                    stale |= m.adapter_changes != changes
                    stale |= bool(state.served_models and new_loras - state.served_models - loras)
                    changes, loras = m.adapter_changes, new_loras
                now = time.monotonic()
                if ok and (now >= next_models or (stale and now >= last_models + MODELS_MIN_GAP_S)):
                    await self.fetch_models(endpoint, models)  # awaited: one in flight at most
                    last_models, stale = now, False
                    next_models = time.monotonic() + MODELS_REFRESH_S
                await asyncio.sleep(self.interval if ok else max(self.interval, 0.2))
        finally:
            getter.close()
            models.close()

    async def close(self) -> None:
        await self._tasks.close()

"""/metrics: vLLM's names, types and labels, and exact counts under concurrency and n > 1."""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvgate.api.contracts import metrics as names
from kvgate.testing.engine_server import EngineProcess

from .conftest import API_KEY

AUTH = {"authorization": f"Bearer {API_KEY}"}
BASE_LABELS = {"model_name": "sim-model", "engine": "0"}


def _families(eng: EngineProcess) -> dict:
    text = httpx.get(f"{eng.base_url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_exposition_names_types_and_labels(sim_engine: EngineProcess) -> None:
    raw = httpx.get(f"{sim_engine.base_url}/metrics")
    assert raw.headers["content-type"].startswith("text/plain")
    exposed = {line.split("{")[0].split(" ")[0] for line in raw.text.splitlines() if line and line[0] != "#"}
    fams = _families(sim_engine)
    gauges = [
        names.NUM_REQUESTS_RUNNING,
        names.NUM_REQUESTS_WAITING,
        names.KV_CACHE_USAGE_PERC,
        names.GPU_CACHE_USAGE_PERC,
    ]
    counters = [
        names.PROMPT_TOKENS_TOTAL,
        names.GENERATION_TOKENS_TOTAL,
        names.PREFIX_CACHE_QUERIES_TOTAL,
        names.PREFIX_CACHE_HITS_TOTAL,
        names.NUM_PREEMPTIONS_TOTAL,
        names.REQUEST_SUCCESS_TOTAL,
    ]
    histograms = [
        names.TIME_TO_FIRST_TOKEN_SECONDS,
        names.INTER_TOKEN_LATENCY_SECONDS,
        names.E2E_REQUEST_LATENCY_SECONDS,
    ]
    for name in gauges:
        assert fams[name].type == "gauge"
        assert name in exposed
        assert fams[name].samples[0].labels == BASE_LABELS
    for name in counters:
        family = fams[name.removesuffix("_total")]
        assert family.type == "counter"
        assert name in exposed  # exactly vLLM's exposed name, with one _total
        for sample in family.samples:
            if sample.name == name:
                assert {k: v for k, v in sample.labels.items() if k != "finished_reason"} == BASE_LABELS
    reasons = {
        s.labels["finished_reason"] for s in fams["vllm:request_success"].samples if s.name.endswith("_total")
    }
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    for name in histograms:
        assert fams[name].type == "histogram"
        assert f"{name}_bucket" in exposed and f"{name}_sum" in exposed and f"{name}_count" in exposed
    ttft_buckets = [
        s.labels["le"] for s in fams[names.TIME_TO_FIRST_TOKEN_SECONDS].samples if s.name.endswith("_bucket")
    ]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"

    info = fams[names.CACHE_CONFIG_INFO]
    assert info.type == "gauge"
    (sample,) = info.samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "16"
    assert sample.labels["num_gpu_blocks"] == "256"
    assert sample.labels["enable_prefix_caching"] == "True"
    assert sample.labels["engine"] == "0"
    _check_hash_algo_label(sample.labels["prefix_caching_hash_algo"])
    lora = fams[names.LORA_REQUESTS_INFO]
    (sample,) = lora.samples
    assert set(sample.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert sample.value > 1e9  # vLLM sets it to the time of the last change


def _check_hash_algo_label(algo: str) -> None:
    """The label names the hash the prefix cache really uses: hashlib's `algo` reproduces a
    block hash (parent seed, no-LoRA key, then the token ids as little-endian u32)."""
    import hashlib
    import struct

    from kvgate.engine.core.block_pool import hash_block_tokens

    tokens = list(range(100, 116))
    h = hashlib.new(algo, digest_size=8) if algo.startswith("blake2") else hashlib.new(algo)
    h.update(struct.pack("<Q", 0x6B7667617465) + struct.pack("<Q", 0xFFFFFFFFFFFFFFFF))
    h.update(struct.pack("<16I", *tokens))
    assert int.from_bytes(h.digest()[:8], "little") == hash_block_tokens(None, tokens)


async def _one(client: httpx.AsyncClient, base: str, i: int) -> dict:
    stream = i % 2 == 0
    body = {
        "prompt": f"request number {i} " * (1 + i % 5),
        "max_tokens": 5 + i % 7,
        "n": 2,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    r = await client.post(f"{base}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_counts_are_exact_under_concurrency_and_n(sim_engine: EngineProcess) -> None:
    before = sim_engine.metrics()

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(_one(client, sim_engine.base_url, i) for i in range(20)))

    usages = asyncio.run(run())
    after = sim_engine.metrics()

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    engine_requests = 20 * 2
    completion = sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == completion
    # vLLM counts each of the n sequences' prompt once: the usage block counts the prompt once.
    assert delta("vllm:prompt_tokens_total") == sum(2 * u["prompt_tokens"] for u in usages)
    length_key = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"}'
    assert delta(length_key) == engine_requests
    assert delta("vllm:time_to_first_token_seconds_count") == engine_requests
    assert delta("vllm:e2e_request_latency_seconds_count") == engine_requests
    assert delta("vllm:inter_token_latency_seconds_count") == completion - engine_requests
    assert delta("vllm:prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usages)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:gpu_cache_usage_perc"] == 0

"""A `kvgate engine serve --simulate` with a host KV tier, seen from outside: a prompt its small
device pool evicted comes back from the tier (usage says how many cached tokens came from it),
the tier's stores reach a plain ZMQ subscriber as vLLM-layout BlockStored events with medium
"CPU", and /metrics carries vLLM's names for the tier (vllm:cpu_cache_usage_perc,
vllm:external_prefix_cache_*, num_cpu_blocks in vllm:cache_config_info)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import httpx
import msgpack

from kvgate.testing.engine_server import EngineProcess, subscribe_kv_events


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def test_an_evicted_prompt_comes_back_from_the_host_tier(
    engine_factory: Callable[..., EngineProcess],
) -> None:
    eng = engine_factory(
        "--simulate",
        "--sim-itl", "0.001",
        "--sim-prefill-time-per-token", "0.00001",
        "--sim-kv-blocks", "10",
        "--sim-cpu-kv-blocks", "64",
        "--max-model-len", "160",
        "--kv-events-endpoint", "tcp://127.0.0.1:*",
    )  # fmt: skip

    def complete(prompt: str) -> dict:
        r = httpx.post(
            f"{eng.base_url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    assert eng.kv_endpoint is not None
    sub = subscribe_kv_events(eng.kv_endpoint, lambda: complete(f"warm {uuid.uuid4().hex}"))
    a = " ".join(f"apple{i}" for i in range(40))
    b = " ".join(f"berry{i}" for i in range(40))
    first = complete(a)
    assert first["prompt_tokens"] > 6 * 16  # 7+ blocks of the 10-block device pool
    complete(b)  # takes most of the device pool: A's blocks go to the host tier
    again = complete(a)
    details = again["prompt_tokens_details"]
    assert details["cached_tokens"] >= 6 * 16
    assert details["cached_tokens_cpu"] > 0

    cpu_stored = []
    while sub.poll(500):
        _topic, _seq, payload = sub.recv_multipart()
        _ts, events, *_ = msgpack.unpackb(payload, raw=False)
        cpu_stored += [e for e in events if e[0] == "BlockStored" and e[6] == "CPU"]
    assert cpu_stored
    tag, hashes, _parent, token_ids, block_size, _lora, medium = cpu_stored[0]
    assert (tag, block_size, medium, len(token_ids)) == ("BlockStored", 16, "CPU", 16 * len(hashes))

    text = httpx.get(f"{eng.base_url}/metrics", timeout=10).text
    assert 'num_cpu_blocks="64"' in text
    assert _metric(text, "vllm:cpu_cache_usage_perc") > 0
    assert _metric(text, "vllm:external_prefix_cache_hits_total") == details["cached_tokens_cpu"]
    assert _metric(text, "kvgate:kv_offload_loads_total") * 16 == details["cached_tokens_cpu"]
    assert _metric(text, "kvgate:kv_offload_stores_total") > 0
    assert _metric(text, "kvgate:kv_offload_seconds_total") > 0
    assert "vllm:prompt_tokens_by_source_total{" in text
    by_source = re.search(
        r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)', text
    )
    assert by_source and float(by_source.group(1)) == details["cached_tokens_cpu"]

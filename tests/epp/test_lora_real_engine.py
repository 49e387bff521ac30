"""LoRA-aware picking against a real simulated engine: what it serves (GET /v1/models), its
vllm:lora_requests_info and its KV events decide which requests name an adapter and which
cached blocks each may use."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.kv_subscriber import KVEventSubscribers
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.adapters import request_adapter
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scraper import MAPPINGS, MetricsScraper
from kvgate.testing import eventually_async
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(90)

PROMPT = "the base model caches this prompt " * 8


def request_for(model: str, token_ids: list[int]) -> InferenceRequest:
    req = InferenceRequest("r", model, model, {"model": model, "prompt": PROMPT})
    req._token_ids = token_ids  # the engine's own tokens (from its /tokenize)
    return req


async def test_base_requests_match_the_engines_blocks_and_adapters_do_not(tmp_path) -> None:
    eng = harness.start_engine(tmp_path)
    try:
        await asyncio.to_thread(eng.wait_ready)
        ds = Datastore()
        scraper = MetricsScraper(ds, MAPPINGS["vllm"], interval=0.05)
        subs = KVEventSubscribers(ds)
        try:
            ds.set_endpoints([Endpoint(eng.address, kv_events=eng.kv_events, kv_replay=eng.kv_replay)])
            state = ds.all()[0]
            await eventually_async(lambda: state.served_models, 20, "the engine's models listed")
            async with httpx.AsyncClient(base_url=f"http://{eng.address}") as c:
                base = (await c.get("/v1/models")).json()["data"][0]["id"]
                r = await c.post("/v1/completions", json={"model": base, "prompt": PROMPT, "max_tokens": 1})
                assert r.status_code == 200
                tokens = (await c.post("/tokenize", json={"model": base, "prompt": PROMPT})).json()["tokens"]
            await eventually_async(
                lambda: state.kv_events_live and ds.index.block_count(eng.address), 20, "the prompt's blocks"
            )
            assert state.served_adapters == frozenset() and state.metrics.max_lora == 0

            def ctx(model: str) -> SchedulingContext:
                return SchedulingContext(request_for(model, tokens), ds, time.monotonic())

            assert request_adapter(ctx(base)) is None
            assert request_adapter(ctx("sql-lora")) == "sql-lora"  # not a base model the pool lists
            prefix = PrecisePrefixCacheScorer(recent_window_seconds=0)
            assert prefix.score(ctx(base), ds.all()) == [1.0]
            # the engine keys an adapter's blocks apart: the base model's are no hit for it
            assert prefix.score(ctx("sql-lora"), ds.all()) == [0.0]
            # an adapter request on an engine without LoRA slots scores 0; the base model 1
            affinity = LoraAffinityScorer()
            assert affinity.score(ctx("sql-lora"), ds.all()) == [0.0]
            assert affinity.score(ctx(base), ds.all()) == [1.0]
        finally:
            await subs.close()
            await scraper.close()
    finally:
        harness.stop_all(eng.proc)

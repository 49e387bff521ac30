"""The EPP and a host KV tier: the precise index keeps each block's tier from the events'
`medium`, a prefix that runs on into the host tier counts as servable (not computed) there, the
predicted-latency scorer charges such blocks their copy time (learnt from the engine's copy
counters) instead of calling them hits or misses, and llm-d's two-scorer arrangement reads both."""

from __future__ import annotations

import pytest

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.epp.datastore import Datastore, EndpointMetrics
from kvgate.epp.prefix_index import PreciseIndex, block_keys
from kvgate.epp.scheduling.config import build_profiles, load_config
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scheduling.plugins.predicted_latency_scorer import LatencyModel, PredictedLatencyScorer
from tests.epp.plugins.test_predicted_latency_scorer import NOW, PER_TOKEN, STEP, pool, request

BS = 4
TOKENS = list(range(1, 41))  # 10 blocks


def _stored(first: int, last: int, medium: str = "GPU") -> BlockStored:
    """Engine hashes first..last (1-based) for blocks first-1..last-1 of TOKENS."""
    return BlockStored(
        block_hashes=list(range(first, last + 1)),
        parent_block_hash=None if first == 1 else first - 1,
        token_ids=TOKENS[(first - 1) * BS : last * BS],
        block_size=BS,
        medium=medium,
    )


def test_the_index_keeps_each_blocks_tier_and_a_run_goes_on_through_the_host() -> None:
    index = PreciseIndex()
    keys = block_keys(TOKENS, BS)
    # device: blocks 1-4; host: 4-8 (block 4 in both), its parents resolved across tiers
    index.apply("e:1", [_stored(1, 4), _stored(4, 4, "CPU"), _stored(5, 8, "CPU")])
    assert index.block_count("e:1") == 4 and index.host_block_count("e:1") == 5
    on_device = index.prefix_blocks(keys, ["e:1"])
    assert on_device == {"e:1": 4}
    assert index.extend_through_host(keys, on_device) == {"e:1": 8}
    # a CPU removal leaves the device copy, a GPU removal the host copy
    index.apply("e:1", [BlockRemoved([4], medium="CPU")])
    assert index.prefix_blocks(keys, ["e:1"]) == {"e:1": 4}
    assert index.extend_through_host(keys, {"e:1": 4}) == {"e:1": 8}  # 5.. follow block 4 on the device
    index.apply("e:1", [BlockRemoved([4], medium="GPU")])
    assert index.prefix_blocks(keys, ["e:1"]) == {"e:1": 3}
    assert index.extend_through_host(keys, {"e:1": 3}) == {"e:1": 3}  # block 4 is nowhere now
    # an engine without a tier: nothing changes; AllBlocksCleared drops both tiers
    index.apply("plain:1", [_stored(1, 2)])
    assert index.extend_through_host(keys, {"plain:1": 2}) == {"plain:1": 2}
    index.apply("e:1", [AllBlocksCleared()])
    assert index.host_block_count("e:1") == 0 and index.block_count("e:1") == 0


def test_a_vllm_event_without_medium_is_a_device_block() -> None:
    index = PreciseIndex()
    index.apply("e:1", [BlockStored([1], None, TOKENS[:BS], BS, medium=None)])
    assert index.block_count("e:1") == 1 and index.host_block_count("e:1") == 0


def _ctx(store: Datastore) -> SchedulingContext:
    return SchedulingContext(request("".join(chr(t) for t in TOKENS) + "?"), store, NOW)


def _store_with_tiers() -> Datastore:
    """tiered:1 holds blocks 1-2 on its device and 3-10 in its host tier; gpu:1 holds 1-5 on its
    device; cold:1 nothing."""
    store = pool({"tiered:1": 0, "gpu:1": 0, "cold:1": 0})
    store.index.apply("tiered:1", [_stored(1, 2), _stored(3, 10, "CPU")])
    store.index.apply("gpu:1", [_stored(1, 5)])
    return store


def test_the_gpu_scorer_counts_the_device_and_the_any_tier_scorer_both() -> None:
    store = _store_with_tiers()
    endpoints = store.all()
    gpu = PrecisePrefixCacheScorer(block_size=BS, recent_window_seconds=0.0)
    anywhere = PrecisePrefixCacheScorer(block_size=BS, recent_window_seconds=0.0, tier="any")
    assert gpu.score(_ctx(store), endpoints) == [0.2, 0.5, 0.0]
    assert anywhere.score(_ctx(store), endpoints) == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="tier"):
        PrecisePrefixCacheScorer(tier="disk")


def test_a_host_tier_hit_costs_its_copy_not_a_recompute() -> None:
    store = _store_with_tiers()
    s = PredictedLatencyScorer(
        block_size=BS,
        prior_seconds_per_token=PER_TOKEN,
        prior_seconds_per_step=STEP,
        work_penalty=0.0,
        eviction_penalty=0.0,
        recent_window_seconds=0.0,
    )
    got = s.predict(_ctx(store), store.all())
    copy = PER_TOKEN * s.model.prior_copy_fraction
    n = len(TOKENS) + 1
    assert got["cold:1"] == pytest.approx(n * PER_TOKEN + STEP)
    assert got["gpu:1"] == pytest.approx((n - 20) * PER_TOKEN + STEP)
    # 8 blocks copied back, 1 token computed
    assert got["tiered:1"] == pytest.approx(1 * PER_TOKEN + 32 * copy + STEP)
    assert got["tiered:1"] < got["gpu:1"] < got["cold:1"]


def test_copy_speed_is_learnt_per_endpoint_from_the_copy_counters() -> None:
    model = LatencyModel(prior_seconds_per_token=PER_TOKEN)
    store = pool({"e:1": 0})
    state = store.get("e:1")
    assert state is not None
    seconds = blocks = 0.0
    for i in range(1, 6):
        seconds += 0.016  # 100 blocks of 16 tokens in 16 ms: 10 µs a token
        blocks += 100
        state.metrics = EndpointMetrics(
            updated_at=NOW + i, kv_copy_seconds_total=seconds, kv_blocks_copied_total=blocks
        )
        speed = model.observe(state, block_size=16)
    assert model.copy_seconds_per_token(speed) == pytest.approx(1e-5)
    # an engine that never copied: the pool's figure, which moved from the prior too
    assert model.copy_seconds_per_token(model.speed("other:1")) == pytest.approx(1e-5)


def test_tokens_loaded_or_pulled_are_not_taken_for_computed_ones() -> None:
    """Prefill speed is computed tokens over busy time: the host tier's loads (and P/D pulls),
    vllm:external_prefix_cache_hits_total, are not computed, or the engine looks faster."""
    model = LatencyModel(prior_seconds_per_token=PER_TOKEN, window_seconds=1.0)
    store = pool({"e:1": 5000})
    state = store.get("e:1")
    assert state is not None
    prompt = external = 0.0
    for i in range(1, 41):
        prompt += 600  # 300 computed + 300 loaded from the host tier
        external += 300
        state.metrics = EndpointMetrics(
            updated_at=NOW + 0.25 * i,
            prefill_tokens_pending=5000,
            prompt_tokens_total=prompt,
            external_hits_total=external,
        )
        speed = model.observe(state)
    assert speed.seconds_per_token == pytest.approx(0.25 / 300, rel=0.02)


def test_the_scraper_reads_the_host_tier_and_its_copy_counters() -> None:
    from kvgate.epp.scraper import MAPPINGS, parse_metrics

    text = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            'vllm:cache_config_info{block_size="16",num_cpu_blocks="7200",num_gpu_blocks="1800"} 1.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 4800.0',
            'kvgate:kv_offload_seconds_total{engine="0",model_name="m"} 0.5',
            'kvgate:kv_offload_stores_total{engine="0",model_name="m"} 900.0',
            'kvgate:kv_offload_loads_total{engine="0",model_name="m"} 300.0',
        ]
    )
    m = parse_metrics(text, MAPPINGS["vllm"], now=5.0)
    assert (m.kv_blocks_total, m.host_kv_blocks_total, m.external_hits_total) == (1800, 7200, 4800.0)
    assert (m.kv_copy_seconds_total, m.kv_blocks_copied_total) == (0.5, 1200.0)
    plain = parse_metrics(
        text.replace('num_cpu_blocks="7200"', 'num_cpu_blocks="None"'), MAPPINGS["vllm"], 5.0
    )
    assert plain.host_kv_blocks_total is None


def test_the_llm_d_tiered_profile_builds_with_both_prefix_scorers() -> None:
    profile = build_profiles(load_config(None, "llm-d-tiered"))[0]
    tiers = sorted(p.tier for p in profile.plugins() if isinstance(p, PrecisePrefixCacheScorer))
    assert tiers == ["any", "gpu"]

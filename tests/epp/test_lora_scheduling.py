"""LoRA-aware scheduling: which requests name an adapter, affinity scoring and filtering, the
built-in profiles, and the precise prefix index keyed per adapter."""

from __future__ import annotations

import time

import pytest

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.api.lora import lora_int_id
from kvgate.epp.datastore import Datastore, EndpointMetrics
from kvgate.epp.scheduling.adapters import request_adapter
from kvgate.epp.scheduling.config import build_profiles, load_config
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.lora_affinity_filter import LoraAffinityFilter
from kvgate.epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer

PROMPT = "a shared system prompt that is long enough for several blocks"


@pytest.fixture
def pool(store: Datastore) -> Datastore:
    """Three engines serving base model "base" with adapters "a" and "b" (as GET /v1/models says)."""
    for s in store.all():
        s.served_models = frozenset({"base", "a", "b"})
        s.served_adapters = frozenset({"a", "b"})
    return store


def ctx(store: Datastore, req, model: str, prompt: str = PROMPT) -> SchedulingContext:
    return SchedulingContext(req(prompt, model=model), store, time.monotonic())


def lora_state(store: Datastore, address: str, max_lora: int, running=(), waiting=()) -> None:
    store.update_metrics(
        address,
        EndpointMetrics(
            updated_at=time.monotonic(),
            max_lora=max_lora,
            running_loras=frozenset(running),
            waiting_loras=frozenset(waiting),
        ),
    )


def test_lora_int_id_is_stable_positive_and_distinct() -> None:
    assert lora_int_id("sql-lora") == lora_int_id("sql-lora")
    ids = {lora_int_id(f"adapter-{i}") for i in range(1000)}
    assert len(ids) == 1000 and all(0 < i < 2**63 for i in ids)


def test_request_adapter_from_models_and_metrics(pool: Datastore, req, store: Datastore) -> None:
    assert request_adapter(ctx(pool, req, "base")) is None
    assert request_adapter(ctx(pool, req, "a")) == "a"
    # listed nowhere yet (to be loaded at runtime) but not a base model: an adapter
    assert request_adapter(ctx(pool, req, "c")) == "c"


def test_request_adapter_without_model_lists(store: Datastore, req) -> None:
    a = store.all()[0].address
    assert request_adapter(ctx(store, req, "x")) is None  # nothing known: treat as base
    lora_state(store, a, 2, running=["x"])
    assert request_adapter(ctx(store, req, "x")) == "x"  # an engine runs it


def test_affinity_scorer_prefers_running_then_free_slot(pool: Datastore, req) -> None:
    a, b, c = (s.address for s in pool.all())
    lora_state(pool, a, 2, running=["b", "a"])
    lora_state(pool, b, 2, running=["b"])
    lora_state(pool, c, 2, running=["b", "x"])
    s = LoraAffinityScorer()
    assert s.score(ctx(pool, req, "a"), pool.all()) == [1.0, 0.5, 0.0]
    lora_state(pool, c, 2, waiting=["a"])
    assert s.score(ctx(pool, req, "a"), pool.all())[2] == 1.0
    # base-model requests need no slot: a full engine is as good as any
    assert s.score(ctx(pool, req, "base"), pool.all()) == [1.0, 1.0, 1.0]


def test_affinity_filter_passes_base_requests(pool: Datastore, req) -> None:
    a, b, c = (s.address for s in pool.all())
    lora_state(pool, a, 1, running=["b"])
    lora_state(pool, b, 1, running=["b"])
    lora_state(pool, c, 2, running=["b"])
    f = LoraAffinityFilter()
    assert [e.address for e in f.filter(ctx(pool, req, "base"), pool.all())] == [a, b, c]
    assert [e.address for e in f.filter(ctx(pool, req, "a"), pool.all())] == [c]


def test_kvgates_filter_drops_only_engines_where_the_adapter_waits_for_a_slot(pool: Datastore, req) -> None:
    a, b, c = (s.address for s in pool.all())
    lora_state(pool, a, 2, running=["a"])  # runs it
    lora_state(pool, b, 2, running=["x"])  # a free slot: may take it (a hot adapter spreads)
    lora_state(pool, c, 2, running=["x", "y"])  # every slot busy: it would wait there
    spread = LoraAffinityFilter(loaded_only=False)
    assert [e.address for e in spread.filter(ctx(pool, req, "a"), pool.all())] == [a, b]
    assert [e.address for e in LoraAffinityFilter().filter(ctx(pool, req, "a"), pool.all())] == [a]
    lora_state(pool, a, 2, running=["x", "y"])
    lora_state(pool, b, 2, running=["x", "y"])  # nowhere to go without a wait: all stay
    assert len(spread.filter(ctx(pool, req, "a"), pool.all())) == 3
    # the built-in precise-prefix profile runs it: an adapter never lands where it would wait
    lora_state(pool, a, 2, running=["x", "y"])
    lora_state(pool, b, 2, running=["x"])
    lora_state(pool, c, 2, running=["x", "y"])
    (profile,) = build_profiles(load_config(None, "precise-prefix"))
    for i in range(5):
        result = profile.run(ctx(pool, req, "a", f"{i} {PROMPT}"), pool.all())
        assert result.targets[0].address == b, result.scores


@pytest.mark.parametrize("profile_name", ["default", "precise-prefix"])
def test_builtin_profiles_send_an_adapter_where_it_runs(pool: Datastore, req, profile_name: str) -> None:
    a, b, c = (s.address for s in pool.all())
    (profile,) = build_profiles(load_config(None, profile_name))
    for i in range(5):  # different prompts: the prefix scorers have no preference
        lora_state(pool, a, 1, running=["b"])
        lora_state(pool, b, 1, running=["a"])
        lora_state(pool, c, 1, running=["b"])
        result = profile.run(ctx(pool, req, "a", f"{i} {PROMPT}"), pool.all())
        assert result.targets[0].address == b, result.scores
        # the base model goes anywhere; the adapter's scorer does not pin it to b
        lora_state(pool, b, 1, running=["a"], waiting=["a"])
        picks = {
            profile.run(ctx(pool, req, "base", f"{i}{j} other"), pool.all()).targets[0].address
            for j in range(12)
        }
        assert len(picks) > 1, picks


def test_precise_prefix_is_keyed_per_adapter(pool: Datastore, req, char_tokenizer) -> None:
    a, b, _ = (s.address for s in pool.all())
    tokens = char_tokenizer.encode(PROMPT)
    full = len(tokens) - len(tokens) % 16
    n = full // 16
    pool.index.apply(
        a, [BlockStored(list(range(1, n + 1)), None, tokens[:full], 16, lora_id=lora_int_id("a"))]
    )
    pool.index.apply(b, [BlockStored(list(range(1, n + 1)), None, tokens[:full], 16, lora_id=None)])
    for s in pool.all():
        s.kv_events_live = True
    scorer = PrecisePrefixCacheScorer(recent_window_seconds=0)
    assert scorer.score(ctx(pool, req, "a"), pool.all()) == [1.0, 0.0, 0.0]
    assert scorer.score(ctx(pool, req, "base"), pool.all()) == [0.0, 1.0, 0.0]
    assert scorer.score(ctx(pool, req, "b"), pool.all()) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("model", ["a", "base"])
def test_precise_prefix_starts_a_cold_model_on_the_least_loaded_engine(
    pool: Datastore, req, model: str
) -> None:
    """A prompt cached nowhere costs the same prefill everywhere; the predicted latency ties, and
    the load tie-break puts it (and so the prefix it seeds) where it disturbs least: hot adapters
    start out on different engines instead of sharing one by chance."""
    a, b, c = (s.address for s in pool.all())
    now = time.monotonic()
    for address, running in ((a, 6), (b, 0), (c, 3)):
        pool.update_metrics(
            address,
            EndpointMetrics(
                updated_at=now, running=running, max_lora=2, running_loras=frozenset({"x"} if running else ())
            ),
        )
    (profile,) = build_profiles(load_config(None, "precise-prefix"))
    picks = [
        profile.run(ctx(pool, req, model, f"{i} {PROMPT}"), pool.all()).targets[0].address for i in range(12)
    ]
    assert picks == [b] * 12

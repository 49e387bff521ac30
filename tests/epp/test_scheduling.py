"""Every filter, scorer and picker, the config loader, saturation and the director."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.prefix_index import block_keys
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling import filters, pickers, scorers
from kvgate.epp.scheduling.config import (
    BUILTIN_PROFILES,
    ConfigError,
    build_profiles,
    load_config,
    parse_config,
    saturation_detector,
)
from kvgate.epp.scheduling.framework import SchedulingContext

make_request = None  # set by the autouse fixture below (conftest is not importable)
CharTokenizer = None


@pytest.fixture(autouse=True)
def _helpers(req, char_tokenizer) -> None:
    global make_request, CharTokenizer
    make_request = req
    CharTokenizer = type(char_tokenizer)


def ctx_for(store: Datastore, request=None) -> SchedulingContext:
    return SchedulingContext(request or make_request(), store, time.monotonic())


def set_metrics(store: Datastore, address: str, **kw) -> None:
    store.update_metrics(address, EndpointMetrics(updated_at=time.monotonic(), **kw))


# -- filters -------------------------------------------------------------------------------------
def test_fresh_metrics_filter_drops_stale(store: Datastore) -> None:
    a, b, c = store.all()
    b.metrics.updated_at = time.monotonic() - 10
    c.metrics.updated_at = 0.0
    assert filters.FreshMetricsFilter(staleness_seconds=2).filter(ctx_for(store), store.all()) == [a]


def test_low_queue_filter(store: Datastore) -> None:
    a, b, _ = (s.address for s in store.all())
    set_metrics(store, a, waiting=3)
    set_metrics(store, b, waiting=200)
    kept = filters.LowQueueFilter(threshold=128).filter(ctx_for(store), store.all())
    assert [e.address for e in kept] == [a, store.all()[2].address]


def test_least_queue_and_least_kv_filters_keep_lowest_band(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, waiting=0, kv_usage=0.1)
    set_metrics(store, b, waiting=1, kv_usage=0.9)
    set_metrics(store, c, waiting=9, kv_usage=0.5)
    ctx = ctx_for(store)
    assert [e.address for e in filters.LeastQueueFilter().filter(ctx, store.all())] == [a, b]
    assert [e.address for e in filters.LeastKVCacheFilter().filter(ctx, store.all())] == [a]


def test_lora_affinity_filter(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, max_lora=1, running_loras=frozenset({"other"}))
    set_metrics(store, b, max_lora=2, running_loras=frozenset({"other"}))
    set_metrics(store, c, max_lora=2, waiting_loras=frozenset({"m"}))
    f = filters.LoraAffinityFilter()
    assert [e.address for e in f.filter(ctx_for(store), store.all())] == [c]
    assert [e.address for e in f.filter(ctx_for(store), store.all()[:2])] == [b]


# -- scorers -------------------------------------------------------------------------------------
def test_queue_scorer_min_max(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, waiting=0)
    set_metrics(store, b, waiting=5)
    set_metrics(store, c, waiting=10)
    assert scorers.QueueScorer().score(ctx_for(store), store.all()) == [1.0, 0.5, 0.0]
    for s in store.all():
        s.metrics.waiting = 4
    assert scorers.QueueScorer().score(ctx_for(store), store.all()) == [1.0, 1.0, 1.0]


def test_kv_cache_scorer(store: Datastore) -> None:
    a = store.all()[0].address
    set_metrics(store, a, kv_usage=0.75)
    assert scorers.KVCacheUtilizationScorer().score(ctx_for(store), store.all()) == [0.25, 1.0, 1.0]


def test_load_aware_scorer_uses_larger_of_scrape_and_inflight_with_response_phase(store: Datastore) -> None:
    a, b, c = store.all()
    set_metrics(store, a.address, running=4, waiting=4)
    b.inflight = 4
    c.inflight = 40
    store.inflight_tracked = True
    assert scorers.LoadAwareScorer(threshold=16).score(ctx_for(store), store.all()) == [0.5, 0.75, 0.0]


def test_load_without_response_phase_is_scrape_plus_unconfirmed_picks(store: Datastore) -> None:
    a, b, c = store.all()
    set_metrics(store, a.address, running=4, waiting=4)
    c.inflight = 40  # never decremented without the response phase: must not count
    t0 = time.monotonic()
    for i in range(4):
        b.note_pick(t0 + i * 0.001)
    scorer = scorers.LoadAwareScorer(threshold=16)
    assert scorer.score(ctx_for(store), store.all()) == [0.5, 0.75, 1.0]
    assert [e.queue() for e in store.all()] == [4, 4, 0]
    # a scrape sent before the picks settled shows none of them yet: all still count
    store.update_metrics(b.address, EndpointMetrics(running=1, updated_at=t0 + 0.01, sent_at=t0 + 0.002))
    assert b.load() == 5
    # a scrape sent well after them shows them in the engine's own counts: ours are dropped
    store.update_metrics(b.address, EndpointMetrics(running=4, updated_at=t0 + 0.2, sent_at=t0 + 0.1))
    assert b.load() == 4 and b.pending == 0


def test_lora_affinity_scorer(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    set_metrics(store, a, max_lora=2, running_loras=frozenset({"m"}))
    set_metrics(store, b, max_lora=2, running_loras=frozenset({"x"}))
    set_metrics(store, c, max_lora=1, running_loras=frozenset({"x"}))
    assert scorers.LoraAffinityScorer().score(ctx_for(store), store.all()) == [1.0, 0.5, 0.0]


def test_approximate_prefix_scorer_learns_from_routing(store: Datastore) -> None:
    scorer = scorers.PrefixCacheScorer(block_size=4)
    _a, b, _ = store.all()
    first = ctx_for(store, make_request("abcdefghijkl"))
    assert scorer.score(first, store.all()) == [0.0, 0.0, 0.0]
    scorer.pre_request(first, b)
    again = ctx_for(store, make_request("abcdefgh-other"))
    assert scorer.score(again, store.all()) == pytest.approx([0.0, 2 / 3, 0.0])


def test_precise_prefix_scorer_reads_kv_event_index(store: Datastore) -> None:
    a, b, c = store.all()
    for s in (a, b, c):
        s.kv_events_live = True
    prompt = "x" * 32  # 8 blocks of 4 tokens with the char tokenizer
    tokens = CharTokenizer().encode(prompt)
    store.index.apply(b.address, [BlockStored(list(range(8)), None, tokens, 4)])
    store.index.apply(c.address, [BlockStored([1, 2], None, tokens[:8], 4)])
    scorer = scorers.PrecisePrefixCacheScorer(block_size=4, recent_window_seconds=0)
    assert scorer.score(ctx_for(store, make_request(prompt)), store.all()) == [0.0, 1.0, 0.25]


def test_precise_prefix_scorer_falls_back_for_endpoints_without_events(store: Datastore) -> None:
    a, _b, _ = store.all()
    scorer = scorers.PrecisePrefixCacheScorer(block_size=4)
    ctx = ctx_for(store, make_request("y" * 16))
    scorer.pre_request(ctx, a)  # nobody publishes events: routing is remembered
    assert scorer.score(ctx_for(store, make_request("y" * 16)), store.all()) == [1.0, 0.0, 0.0]
    # once a publishes events, its recent routing counts only inside the window
    a.kv_events_live = True
    late = SchedulingContext(make_request("y" * 16), store, time.monotonic() + 60)
    assert scorer.score(late, store.all()) == [0.0, 0.0, 0.0]


def test_precise_prefix_chat_uses_template(store: Datastore) -> None:
    a = store.all()[0]
    a.kv_events_live = True
    req = make_request()
    req.body = {"model": "m", "messages": [{"role": "user", "content": "hi there friend"}]}
    tokens = CharTokenizer().encode("<user>hi there friend<assistant>")
    n = len(tokens) // 4
    store.index.apply(a.address, [BlockStored(list(range(n)), None, tokens[: n * 4], 4)])
    s = scorers.PrecisePrefixCacheScorer(block_size=4).score(ctx_for(store, req), [a])
    assert s == [1.0]
    assert block_keys(tokens, 4)


# -- pickers -------------------------------------------------------------------------------------
def test_max_score_picker_breaks_ties_by_prompt(store: Datastore) -> None:
    """Ties spread over endpoints across prompts, yet one prompt always gets the same endpoint,
    from any picker instance (another EPP replica): replicas agree on ties."""
    from .conftest import make_request

    picker, other_replica = pickers.MaxScorePicker(), pickers.MaxScorePicker()
    eps = store.all()
    assert picker.pick(ctx_for(store), eps, [0.1, 0.9, 0.5])[0] is eps[1]
    wins: Counter[str] = Counter()
    for i in range(200):
        ctx = ctx_for(store, make_request(f"system prompt {i}: be brief"))
        first = picker.pick(ctx, eps, [1.0, 1.0, 0.0])[0]
        assert all(picker.pick(ctx, eps, [1.0, 1.0, 0.0])[0] is first for _ in range(3))
        assert other_replica.pick(ctx, list(reversed(eps)), [0.0, 1.0, 1.0])[0] is first
        wins[first.address] += 1
    assert set(wins) == {eps[0].address, eps[1].address}
    assert min(wins.values()) > 50


def test_tie_breaks_spread_prompts_that_differ_by_a_character() -> None:
    """Prompts of one family ("request number 0 ...", "request number 1 ...") on an idle pool
    of three: with a crc32 seeded by the prompt (affine in its seed) all six went to one
    endpoint for two address sets in three; with an independent hash that is (1/3)^5 = 0.4%."""
    from .conftest import make_request

    rng = random.Random(1)
    picker, all_same = pickers.MaxScorePicker(), 0
    for _ in range(200):
        ds = Datastore()
        ds.set_endpoints([Endpoint(f"127.0.0.1:{rng.randrange(30000, 60000)}") for _ in range(3)])
        eps = ds.all()
        chosen = {
            picker.pick(ctx_for(ds, make_request(f"request number {i} goes somewhere")), eps, [1.0] * 3)[
                0
            ].address
            for i in range(6)
        }
        all_same += len(chosen) == 1
    assert all_same <= 6, all_same


def test_max_score_picker_returns_fallbacks_in_score_order(store: Datastore) -> None:
    eps = store.all()
    picked = pickers.MaxScorePicker(max_num_of_endpoints=3).pick(ctx_for(store), eps, [0.2, 0.9, 0.5])
    assert picked == [eps[1], eps[2], eps[0]]


def test_random_picker_uses_every_endpoint(store: Datastore) -> None:
    picker = pickers.RandomPicker(rng=random.Random(2))
    seen = {picker.pick(ctx_for(store), store.all(), [0, 0, 0])[0].address for _ in range(100)}
    assert len(seen) == 3


def test_weighted_random_picker_follows_weights(store: Datastore) -> None:
    picker = pickers.WeightedRandomPicker(rng=random.Random(3))
    eps = store.all()
    wins = Counter(picker.pick(ctx_for(store), eps, [3.0, 1.0, 0.0])[0].address for _ in range(2000))
    assert wins[eps[2].address] == 0
    assert 2.3 < wins[eps[0].address] / wins[eps[1].address] < 3.9
    assert len({picker.pick(ctx_for(store), eps, [0, 0, 0])[0].address for _ in range(100)}) == 3


def test_round_robin_picker_cycles(store: Datastore) -> None:
    picker = pickers.RoundRobinPicker()
    order = [picker.pick(ctx_for(store), store.all(), [0, 0, 0])[0].address for _ in range(6)]
    assert order[:3] == sorted(order[:3]) and order[:3] == order[3:]


# -- config --------------------------------------------------------------------------------------
def test_every_builtin_profile_builds() -> None:
    for name in BUILTIN_PROFILES:
        (profile,) = build_profiles(load_config(None, name))
        assert profile.name == name


def test_gie_default_profile_weights() -> None:
    (profile,) = build_profiles(load_config(None, "default"))
    assert {s.type_name: w for s, w in profile.scorers} == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
        "lora-affinity-scorer": 2,
    }
    assert profile.picker.type_name == "max-score-picker"


def test_config_yaml_with_parameters_and_saturation(tmp_path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(
        """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: low-queue-filter
  parameters: {threshold: 7}
- type: prefix-cache-scorer
  name: px
  parameters: {blockSize: 32, maxPrefixBlocksToMatch: 10}
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 2}
schedulingProfiles:
- name: mine
  plugins: [{pluginRef: low-queue-filter}, {pluginRef: px, weight: 5}, {pluginRef: max-score-picker}]
saturationDetector: {queueDepthThreshold: 2, kvCacheUtilThreshold: 0.5, metricsStalenessThreshold: 500ms}
objectives: {batch: -1}
"""
    )
    cfg = load_config(str(path))
    (profile,) = build_profiles(cfg)
    assert profile.filters[0].threshold == 7
    scorer, weight = profile.scorers[0]
    assert (scorer.name, scorer.block_size, scorer.max_prefix_blocks, weight) == ("px", 32, 10, 5)
    assert profile.picker.max_num_of_endpoints == 2
    sat = saturation_detector(cfg)
    assert (sat.queue_depth_threshold, sat.kv_cache_util_threshold, sat.metrics_staleness_threshold) == (
        2,
        0.5,
        0.5,
    )
    assert cfg.objectives == {"batch": -1}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kind": "Nope", "schedulingProfiles": []}, "kind must be"),
        (
            {"plugins": [{"type": "no-such"}], "schedulingProfiles": [{"name": "p", "plugins": []}]},
            "unknown plugin type",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer", "parameters": {"bogus": 1}}],
                "schedulingProfiles": [{"name": "p", "plugins": []}],
            },
            "no parameter 'bogus'",
        ),
        (
            {"plugins": [], "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "x"}]}]},
            "unknown plugin 'x'",
        ),
        ({"plugins": []}, "schedulingProfiles is empty"),
    ],
)
def test_bad_config_is_a_clear_error(raw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_unknown_builtin_profile() -> None:
    with pytest.raises(ConfigError, match="built-in profiles"):
        load_config(None, "fastest")


# -- saturation and director ------------------------------------------------------------------
def test_saturation_detector(store: Datastore) -> None:
    det = SaturationDetector(
        queue_depth_threshold=5, kv_cache_util_threshold=0.8, metrics_staleness_threshold=2
    )
    a, b, c = store.all()
    now = time.monotonic()
    set_metrics(store, a.address, waiting=12)  # 2.4
    set_metrics(store, b.address, kv_usage=0.48)  # 0.6
    assert det.endpoint_saturation(a, now) == pytest.approx(2.4)
    assert det.pool_saturation(store.all(), now) == pytest.approx((2.4 + 0.6 + 0.0) / 3)
    assert det.saturated(store.all(), now)
    set_metrics(store, a.address, waiting=1)
    assert not det.saturated(store.all(), now)
    c.metrics.updated_at = now - 5  # stale counts as saturated
    assert det.endpoint_saturation(c, now) == 1.0


def director_for(store: Datastore, profile: str = "precise-prefix") -> Director:
    cfg = load_config(None, profile)
    return Director(store, build_profiles(cfg)[0], saturation_detector(cfg))


def test_director_routes_and_tracks_inflight(store: Datastore) -> None:
    d = director_for(store)
    decision = d.pick(make_request())
    assert decision.routed and len(decision.targets) == 1
    assert store.get(decision.targets[0]).inflight == 1
    assert store.get(decision.targets[0]).pending == 1
    assert "profile=precise-prefix" in decision.reason
    d.finished(decision.targets[0])
    assert store.get(decision.targets[0]).inflight == 0
    assert store.get(decision.targets[0]).pending == 1  # until a scrape shows it


def test_director_sticks_to_prefix_holder_until_it_is_much_busier(store: Datastore) -> None:
    """The fixed-weights profile: the holder loses once it has many more requests than peers."""
    d = director_for(store, "precise-prefix-weights")
    prompt = "shared system prompt " * 10
    first = d.pick(make_request(prompt + "q1")).targets[0]
    # same prefix sticks while the holder is only a little busier
    for i in range(4):
        assert d.pick(make_request(prompt + f"q{i + 2}")).targets[0] == first
    # a holder far busier than its peers loses
    for _ in range(10):  # now 15 picks there that no scrape has shown yet
        store.get(first).note_pick(time.monotonic())
    assert d.pick(make_request(prompt + "late")).targets[0] != first


def test_the_default_keeps_a_prefix_until_the_wait_costs_more_than_recomputing_it(store: Datastore) -> None:
    """The default (predicted latency): the holder keeps the prefix while the prefill work queued
    there costs less than computing the prompt again elsewhere (and what that takes from the
    pool); past that, the request goes to an idle engine."""
    d = director_for(store)
    prompt = "shared system prompt " * 10  # 210 tokens with the char tokenizer
    first = d.pick(make_request(prompt + "q1")).targets[0]
    for i in range(4):  # a little queued work: stays
        store.get(first).note_pick(time.monotonic(), 50)
        assert d.pick(make_request(prompt + f"q{i + 2}")).targets[0] == first
    store.get(first).note_pick(time.monotonic(), 5000)  # far more than recomputing 210 tokens
    assert d.pick(make_request(prompt + "late")).targets[0] != first


def test_director_subset_hint(store: Datastore) -> None:
    d = director_for(store)
    _a, b, _ = (s.address for s in store.all())
    assert d.pick(make_request(subset=[b])).targets == [b]
    assert d.pick(make_request(subset=[])).status == 503
    assert d.pick(make_request(subset=["1.2.3.4:1"])).status == 503


def test_director_no_endpoints_is_503_unreachable_excluded() -> None:
    ds = Datastore()
    assert director_for(ds).pick(make_request()).status == 503
    ds.set_endpoints([Endpoint("10.0.0.1:1"), Endpoint("10.0.0.2:1")])
    ds.update_metrics("10.0.0.2:1", EndpointMetrics(updated_at=time.monotonic()))
    for _ in range(ds.unreachable_after_failures):
        ds.scrape_failed("10.0.0.2:1")
    assert director_for(ds).pick(make_request()).status == 503  # one never scraped, one failing
    ds.update_metrics("10.0.0.1:1", EndpointMetrics(updated_at=time.monotonic()))
    assert director_for(ds).pick(make_request()).targets == ["10.0.0.1:1"]


def test_director_sheds_negative_priority_when_saturated(store: Datastore) -> None:
    d = director_for(store)
    for s in store.all():
        set_metrics(store, s.address, waiting=6)
    assert d.pick(make_request(priority=-1, objective="batch")).status == 429
    assert d.pick(make_request(priority=0)).routed
    for s in store.all():
        set_metrics(store, s.address, waiting=0)
    assert d.pick(make_request(priority=-1)).routed


def test_director_filters_removing_all_is_429(store: Datastore) -> None:
    cfg = parse_config(
        {
            "plugins": [{"type": "low-queue-filter", "parameters": {"threshold": 0}}],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "low-queue-filter"}]}],
        }
    )
    for s in store.all():
        set_metrics(store, s.address, waiting=1)
    d = Director(store, build_profiles(cfg)[0], saturation_detector(cfg))
    assert d.pick(make_request()).status == 429


@pytest.mark.parametrize("profile", ["precise-prefix", "default"])
def test_a_new_pod_on_a_departed_endpoints_address_inherits_no_prefixes(
    store: Datastore, profile: str
) -> None:
    """Pods come and go on recycled ip:ports: what our routing remembered about the old pod (the
    approximate index, and the precise scorer's fallback for engines without KV events) must not
    pull the same prefixes to the newcomer."""
    d = director_for(store, profile)
    prompt = "a long shared system prompt " * 12
    first = d.pick(make_request(prompt + "q1")).targets[0]
    (found,) = [s for s, _ in d.profile.scorers if hasattr(s, "forget_endpoint")]
    scorer = getattr(found, "prefix", found)  # the latency scorer's prefix part, or the scorer
    ctx = ctx_for(store, make_request(prompt + "q2"))
    assert max(scorer.score(ctx, [store.get(first)])) > 0.5  # remembered while it lives

    others = [s.endpoint for s in store.all() if s.address != first]
    store.set_endpoints(others)  # the pod is gone ...
    store.set_endpoints([*others, Endpoint(first, name="new-pod")])  # ... a new one reuses its address
    set_metrics(store, first)
    ctx = ctx_for(store, make_request(prompt + "q3"))
    assert scorer.score(ctx, [store.get(first)]) == [0.0]


def test_precise_prefix_scorer_uses_each_engines_own_block_size(store: Datastore) -> None:
    """Engines started with another --block-size than the scorer's default still score: the size
    comes from their KV events (before, a fixed 16 matched nothing, silently)."""
    a, b, c = store.all()
    for s in (a, b, c):
        s.kv_events_live = True
    prompt = "z" * 64
    tokens = CharTokenizer().encode(prompt)
    store.index.apply(a.address, [BlockStored(list(range(4)), None, tokens, 16)])  # 4 blocks of 16
    store.index.apply(b.address, [BlockStored([7], None, tokens[:32], 32)])  # 1 of 2 blocks of 32
    scorer = scorers.PrecisePrefixCacheScorer(block_size=4, recent_window_seconds=0)
    assert store.index.block_size(a.address) == 16 and store.index.block_size(c.address) is None
    assert scorer.score(ctx_for(store, make_request(prompt)), store.all()) == [1.0, 0.5, 0.0]

"""The config loader, the built-in profiles, saturation and the director (each plugin's own tests
are in tests/epp/plugins/)."""

from __future__ import annotations

import time

import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.saturation import SaturationDetector
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


def test_picks_not_yet_scraped_take_free_batch_slots_before_they_count_as_waiting(store: Datastore) -> None:
    """A burst of short requests (a batch job's lines) to engines with free slots runs at once:
    it must not read as a queue that saturates the pool and sheds the burst's own sheddable work.
    An engine that does not export kvgate:max_num_seqs (vLLM) keeps the old, cautious count."""
    det = SaturationDetector(queue_depth_threshold=5, kv_cache_util_threshold=0.8)
    a, b, _ = store.all()
    now = time.monotonic()
    set_metrics(store, a.address, running=120, max_num_seqs=128)
    set_metrics(store, b.address, running=3)  # slots not said
    for state in (a, b):
        for _ in range(10):
            state.note_pick(now)
    assert a.waiting_after_picks() == 2  # 8 slots free, 10 picks: 2 wait
    assert b.waiting_after_picks() == b.queue() == 10
    assert det.endpoint_saturation(a, now) == pytest.approx(2 / 5)
    assert det.endpoint_saturation(b, now) == pytest.approx(10 / 5)
    set_metrics(store, a.address, running=128, waiting=4, max_num_seqs=128)  # full: every pick waits
    assert a.waiting_after_picks() == 14


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


def test_an_online_request_goes_where_only_sheddable_work_holds_the_slots(store: Datastore) -> None:
    """Engine a runs 8 online requests with 4 waiting; engine b runs 8 batch lines with 4 more
    waiting and their prompts to prefill. By the totals b looks busier, but b's engine would
    preempt those for an online request: it goes to b, and in every profile that reads load.
    A sheddable request sees the totals: by them the pool is saturated, and it is refused."""
    a, b, _ = (s.address for s in store.all())
    store.set_endpoints([Endpoint(a), Endpoint(b)])
    set_metrics(store, a, running=8, waiting=4, max_num_seqs=8, prefill_tokens_pending=1024)
    shed = dict(sheddable_running=8, sheddable_waiting=5, sheddable_prefill_tokens=2048)
    set_metrics(store, b, running=8, waiting=5, max_num_seqs=8, prefill_tokens_pending=2048, **shed)
    for profile in ("precise-prefix", "default", "precise-prefix-weights"):
        d = director_for(store, profile)
        assert d.pick(make_request("hello there", priority=0)).targets == [b], profile
        assert d.pick(make_request("hello again", priority=-1)).status == 429, profile
    # the datastore's own states keep the engine's totals
    assert store.get(b).metrics.waiting == 5 and store.get(b).metrics.sheddable_waiting == 5
    assert store.get(b).pending >= 1  # the pick was recorded on the real state, not the view


def test_without_sheddable_clamps_forged_parts() -> None:
    m = EndpointMetrics(
        waiting=2, running=3, prefill_tokens_pending=10, sheddable_waiting=9, sheddable_running=1
    )
    v = m.without_sheddable()
    assert (v.waiting, v.running, v.prefill_tokens_pending) == (0, 2, 10) and not v.has_sheddable
    assert EndpointMetrics(sheddable_prefill_tokens=5).without_sheddable().prefill_tokens_pending is None


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

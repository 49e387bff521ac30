"""The predicted-latency scorer's estimator, without timing: what it predicts for a cold engine,
a busy prefix holder and an idle one, how its own unconfirmed picks count, and how it learns an
engine's speed from the counters a scrape brings."""

from __future__ import annotations

import pytest

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.framework import PREFILL_TOKENS, SchedulingContext
from kvgate.epp.scheduling.plugins.predicted_latency_scorer import LatencyModel, PredictedLatencyScorer

PER_TOKEN = 0.001  # seconds per prefill token, the prior every test starts from
STEP = 0.02
NOW = 100.0


class Tokens:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def request(prompt: str, max_tokens: int = 10) -> InferenceRequest:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    return InferenceRequest("r", "m", "m", body, tokenizer=Tokens())  # type: ignore[arg-type]


def pool(pending: dict[str, int]) -> Datastore:
    store = Datastore()
    store.set_endpoints([Endpoint(a, kv_events=f"tcp://{a}") for a in pending])
    for state in store.all():
        state.kv_events_live = True
        store.update_metrics(
            state.address,
            EndpointMetrics(updated_at=NOW, sent_at=NOW, prefill_tokens_pending=pending[state.address]),
        )
    return store


def scorer(**kw: float) -> PredictedLatencyScorer:
    defaults = {"work_penalty": 0.0, "eviction_penalty": 0.0, "recent_window_seconds": 0.0}
    return PredictedLatencyScorer(
        block_size=4, prior_seconds_per_token=PER_TOKEN, prior_seconds_per_step=STEP, **{**defaults, **kw}
    )


def hold(store: Datastore, address: str, prompt: str) -> None:
    """The endpoint's KV events say it caches every full block of `prompt`."""
    tokens = Tokens().encode(prompt)
    n = len(tokens) // 4
    store.index.apply(address, [BlockStored(list(range(1, n + 1)), None, tokens[: 4 * n], 4)])


PROMPT = "s" * 400 + "q" * 40  # a 400-token shared prefix, a 40-token question


def predict(s: PredictedLatencyScorer, store: Datastore, prompt: str = PROMPT) -> dict[str, float]:
    ctx = SchedulingContext(request(prompt), store, NOW)
    return s.predict(ctx, store.all())


def test_an_idle_holder_beats_an_idle_cold_engine() -> None:
    store = pool({"holder:1": 0, "cold:1": 0})
    hold(store, "holder:1", PROMPT[:400])
    got = predict(scorer(), store)
    assert got["holder:1"] == pytest.approx(40 * PER_TOKEN + STEP)  # only the question is computed
    assert got["cold:1"] == pytest.approx(440 * PER_TOKEN + STEP)


def test_a_busy_holder_keeps_the_request_while_waiting_is_cheaper_than_recomputing() -> None:
    store = pool({"holder:1": 300, "cold:1": 0})  # 300 tokens queued < the 400 it would recompute
    hold(store, "holder:1", PROMPT[:400])
    got = predict(scorer(), store)
    assert got["holder:1"] < got["cold:1"]


def test_a_holder_whose_queue_costs_more_than_recomputing_loses() -> None:
    store = pool({"holder:1": 500, "cold:1": 0})
    hold(store, "holder:1", PROMPT[:400])
    got = predict(scorer(), store)
    assert got["cold:1"] < got["holder:1"]
    # ... unless computing the prefix again is charged for the work it takes from the pool
    # (the requests queued behind it there): then the holder keeps it.
    assert (
        predict(scorer(work_penalty=1.0), store)["holder:1"]
        < predict(scorer(work_penalty=1.0), store)["cold:1"]
    )


def test_this_replicas_unconfirmed_picks_count_as_queued_work() -> None:
    store = pool({"a:1": 0, "b:1": 0})
    store.get("a:1").note_pick(NOW + 0.01, 1000)  # sent there, no scrape shows it yet
    s = scorer()
    ctx = SchedulingContext(request(PROMPT), store, NOW + 0.02)
    got = s.predict(ctx, store.all())
    assert got["a:1"] - got["b:1"] == pytest.approx(1000 * PER_TOKEN)
    assert ctx.cache[PREFILL_TOKENS] == {"a:1": 440, "b:1": 440}  # what the director records
    assert s.score(ctx, store.all()) == [pytest.approx(got["b:1"] / got["a:1"]), 1.0]


def test_without_the_engines_pending_count_waiting_requests_stand_in() -> None:
    store = pool({"vllm:1": 0})
    store.update_metrics("vllm:1", EndpointMetrics(updated_at=NOW, sent_at=NOW, waiting=3))
    got = predict(scorer(), store)
    assert got["vllm:1"] == pytest.approx((3 * 440 + 440) * PER_TOKEN + STEP)
    store.get("vllm:1").note_pick(NOW + 0.01, 1000)  # and this replica's unconfirmed pick, exactly
    ctx = SchedulingContext(request(PROMPT), store, NOW + 0.02)
    assert scorer().predict(ctx, store.all())["vllm:1"] == pytest.approx(
        (3 * 440 + 1000 + 440) * PER_TOKEN + STEP
    )


def test_engine_speed_is_learnt_from_its_counters() -> None:
    """An engine that really drains 2,000 prefill tokens/s (0.5 ms each) while busy, with a
    30 ms decode step: the model moves from its 1 ms prior to what the counters say."""
    model = LatencyModel(prior_seconds_per_token=PER_TOKEN, prior_seconds_per_step=STEP, window_seconds=1.0)
    store = pool({"e:1": 5000})
    state = store.get("e:1")
    assert state is not None
    prompt = hits = itl_sum = itl_count = 0.0
    for i in range(1, 41):  # 10 s of scrapes every 0.25 s, busy throughout
        prompt += 600  # 500 computed + 100 served from cache
        hits += 100
        itl_sum += 8 * 0.03
        itl_count += 8
        state.metrics = EndpointMetrics(
            updated_at=NOW + 0.25 * i,
            prefill_tokens_pending=5000,
            prompt_tokens_total=prompt,
            prefix_hits_total=hits,
            itl_seconds_sum=itl_sum,
            itl_count=itl_count,
        )
        speed = model.observe(state)
    assert speed.seconds_per_token == pytest.approx(0.0005, rel=0.02)
    assert speed.seconds_per_step == pytest.approx(0.03, rel=0.02)
    # an engine never seen starts from what the pool has learnt, not the prior; predictions use
    # the pool's estimate unless the pool is declared heterogeneous
    assert model.speed("new:1").seconds_per_token == pytest.approx(speed.seconds_per_token)
    assert model.estimate(model.speed("new:1")).seconds_per_token == pytest.approx(0.0005, rel=0.02)


def test_an_idle_engine_teaches_nothing_about_prefill_speed() -> None:
    model = LatencyModel(prior_seconds_per_token=PER_TOKEN, window_seconds=1.0)
    store = pool({"e:1": 0})
    state = store.get("e:1")
    assert state is not None
    for i in range(1, 20):  # prompts trickle in, nothing ever queues
        state.metrics = EndpointMetrics(
            updated_at=NOW + 0.25 * i, prefill_tokens_pending=0, prompt_tokens_total=10.0 * i
        )
        speed = model.observe(state)
    assert speed.seconds_per_token == PER_TOKEN


def test_an_slo_puts_endpoints_that_meet_it_first() -> None:
    """llm-d's x-slo-ttft-ms: the cheaper-for-the-pool holder (predicted 0.56 s) loses to a cold
    engine predicted to meet a 0.5 s objective (0.46 s); without the objective it wins."""
    store = pool({"holder:1": 500, "cold:1": 0})
    hold(store, "holder:1", PROMPT[:400])
    s = scorer(work_penalty=1.0)
    plain = s.score(SchedulingContext(request(PROMPT), store, NOW), store.all())
    assert plain[0] > plain[1]  # holder first
    with_slo = request(PROMPT)
    with_slo.slo_ttft_s = 0.5
    scores = s.score(SchedulingContext(with_slo, store, NOW), store.all())
    assert scores[1] > scores[0]
    impossible = request(PROMPT)
    impossible.slo_ttft_s = 0.01  # nobody can: the plain order stands
    assert s.score(SchedulingContext(impossible, store, NOW), store.all()) == plain


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("250", 0.25), ("1.5", 0.0015), ("", None), ("soon", None), ("-5", None), ("inf", None), ("nan", None)],
)
def test_slo_headers_parse_or_are_ignored(header: str, seconds: float | None) -> None:
    from kvgate.epp.requestcontrol import _milliseconds

    assert _milliseconds(header) == seconds


def test_the_scraper_reads_what_the_model_learns_from() -> None:
    """vLLM's exposition (and kvgate's own pending-prefill gauge) → the fields the model reads."""
    from kvgate.epp.scraper import MAPPINGS, parse_metrics

    text = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1800"} 1.0',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 12000.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 9000.0',
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 4.5',
            'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 150.0',
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0',
            'kvgate:prefill_tokens_pending{engine="0",model_name="m"} 2400.0',
        ]
    )
    m = parse_metrics(text, MAPPINGS["vllm"], now=5.0)
    assert (m.waiting, m.running, m.kv_usage, m.kv_blocks_total) == (2, 3, 0.5, 1800)
    assert (m.prompt_tokens_total, m.prefix_hits_total) == (12000.0, 9000.0)
    assert (m.itl_seconds_sum, m.itl_count, m.prefill_tokens_pending) == (4.5, 150.0, 2400)
    # a plain vLLM says nothing of pending prefill work: None, not 0 (the model then estimates)
    vllm_only = parse_metrics(text.replace("kvgate:prefill_tokens_pending", "x"), MAPPINGS["vllm"], now=5.0)
    assert vllm_only.prefill_tokens_pending is None


def test_the_epp_loads_a_tokenizer_for_the_predicted_latency_profile() -> None:
    """Before: only the precise prefix scorer asked for one, so this profile ran without tokens,
    saw no prefix anywhere and balanced load alone (29% prefix hits where 76% were possible)."""
    from kvgate.api.k8s.crds import TOKEN_SCORERS
    from kvgate.epp.scheduling.config import load_config
    from kvgate.epp.server import needs_tokenizer

    assert needs_tokenizer(load_config(None, "precise-prefix-weights"))
    assert needs_tokenizer(load_config(None, "precise-prefix"))
    assert not needs_tokenizer(load_config(None, "default"))
    # the operator's list (it decides whether the picker pod needs the model's tokenizer) has it:
    # generated from the declarations (tests/epp/test_plugin_registry.py checks it is current)
    assert PredictedLatencyScorer.type_name in TOKEN_SCORERS


def test_one_pick_ranks_every_candidate_with_the_same_speed() -> None:
    """A scrape that teaches the model something, read while scoring the last candidate, must not
    leave the first ones priced at the old speed (it ranked candidates on two scales)."""
    store = pool({"b:1": 0, "a:1": 0})
    s = scorer()
    s.model.window_seconds = 0.0
    a = store.get("a:1")
    assert a is not None
    a.metrics = EndpointMetrics(updated_at=NOW, prefill_tokens_pending=100, prompt_tokens_total=0.0)
    s.model.observe(a)  # the scrape before
    a.metrics = EndpointMetrics(updated_at=NOW + 1, prefill_tokens_pending=100, prompt_tokens_total=100.0)
    got = s.predict(SchedulingContext(request(PROMPT), store, NOW + 1), store.all())  # b first, then a
    learnt = s.model.estimate(s.model.speed("a:1")).seconds_per_token
    assert learnt == pytest.approx(0.01)  # 100 tokens in 1 s
    assert got["b:1"] == pytest.approx(440 * learnt + STEP)
    assert got["a:1"] == pytest.approx((100 + 440) * learnt + STEP)


def test_a_pick_stays_placed_while_it_waits_in_its_engines_queue() -> None:
    """A prefix's first request queued behind 20 s of prefill work: a second request of the
    prefix 10 s later (no KV event yet, far past the 2 s window) follows it there instead of
    computing the prefix a second time on an engine that is a little less busy."""
    store = pool({"busy:1": 20_000, "busier:1": 20_600})
    s = scorer(recent_window_seconds=2.0)
    first = SchedulingContext(request(PROMPT), store, NOW)
    got = s.predict(first, store.all())
    assert min(got, key=got.__getitem__) == "busy:1"
    s.pre_request(first, store.get("busy:1"))
    store.get("busy:1").note_pick(NOW, 440)
    store.update_metrics(
        "busy:1", EndpointMetrics(updated_at=NOW + 10, sent_at=NOW + 10, prefill_tokens_pending=20_440)
    )
    store.update_metrics(
        "busier:1", EndpointMetrics(updated_at=NOW + 10, sent_at=NOW + 10, prefill_tokens_pending=20_600)
    )
    second = SchedulingContext(request("s" * 400 + "Q" * 40), store, NOW + 10)
    got = s.predict(second, store.all())
    assert second.cache[PREFILL_TOKENS]["busy:1"] == 40  # the prefix counts as placed there
    assert min(got, key=got.__getitem__) == "busy:1"


def test_another_replicas_pick_stays_placed_while_it_waits_too() -> None:
    store = pool({"busy:1": 20_000, "idle:1": 0})
    s = scorer(recent_window_seconds=2.0)
    tokens = Tokens().encode(PROMPT)
    uncached = s.observe_admission("busy:1", tokens, NOW, store.index, state=store.get("busy:1"))
    assert uncached == len(tokens)
    later = SchedulingContext(request("s" * 400 + "Q" * 40), store, NOW + 10)
    s.predict(later, store.all())
    assert later.cache[PREFILL_TOKENS]["busy:1"] == 40


def test_a_prompt_cold_everywhere_goes_where_the_fewest_prefixes_live() -> None:
    """Two idle engines; this replica recently sent `a:1` three other prefixes and `b:1` one.
    A new prefix is charged its compute again in proportion to each engine's working set over
    the mean, so it lands on `b:1` (a placement that knew the groups would deal it there);
    with the balance off the two tie."""
    store = pool({"a:1": 0, "b:1": 0})
    s = scorer(balance_penalty=2.0)
    for i, where in enumerate(["a:1", "a:1", "a:1", "b:1"]):
        keys = s.working_sets.sampled([hash(("other", i, b)) for b in range(80)])
        s.working_sets.touch(where, keys, NOW - 1.0)
    got = predict(s, store)
    assert got["b:1"] < got["a:1"]
    held = {"a:1": 3.0, "b:1": 1.0}
    mean = sum(held.values()) / 2
    base = 440 * PER_TOKEN + STEP
    for address in got:
        assert got[address] == pytest.approx(base + 2.0 * 440 * held[address] / mean * PER_TOKEN)
    off = predict(scorer(balance_penalty=0.0), store)
    assert off["a:1"] == off["b:1"]


def test_a_prefix_that_recurs_slowly_still_counts_as_its_engines_to_keep() -> None:
    """At 4 req/s over 64 prefixes a prefix recurs every 16 s on average, and one gap in four
    is longer than 20 s. By default an engine keeps counting a prefix routed there 45 s ago,
    so a new prefix goes where fewer live, not onto an engine that already holds three."""
    store = pool({"a:1": 0, "b:1": 0})
    s = PredictedLatencyScorer(
        block_size=4,
        prior_seconds_per_token=PER_TOKEN,
        prior_seconds_per_step=STEP,
        work_penalty=0.0,
        eviction_penalty=0.0,
        recent_window_seconds=0.0,
    )
    for i, where in enumerate(["a:1", "a:1", "a:1", "b:1"]):
        s.working_sets.touch(
            where, s.working_sets.sampled([hash(("other", i, b)) for b in range(80)]), NOW - 45.0
        )
    got = predict(s, store)
    assert got["b:1"] < got["a:1"]

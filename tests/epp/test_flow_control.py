"""Flow control (kvgate.epp.flow_control): strict priority bands, token-fair order across flows,
FCFS inside a flow, dispatch only where there is room, bounded queues and deadlines — on a real
Director and datastore, with a hand-driven clock and engine metrics."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from dataclasses import replace

import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.flow_control import FlowControlConfig, FlowController, FlowGate, Held, footprint
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.config import build_profiles, load_config

ENGINE = "10.0.0.1:8000"
# Room for one request per idle scrape, whatever its size (the ordering tests count dispatches).
ONE_AT_A_TIME = FlowControlConfig(max_unconfirmed_picks=1, dispatch_prefill_tokens=0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """One engine whose scraped state the test sets: busy (no room) or idle."""

    def __init__(
        self, config: FlowControlConfig | None = None, engines: int = 1, dispatch: str = "endpoint"
    ) -> None:
        config = replace(config or FlowControlConfig(), dispatch=dispatch)
        self.clock = Clock()
        self.store = Datastore()
        self.addresses = [f"10.0.0.{i + 1}:8000" for i in range(engines)]
        self.store.set_endpoints([Endpoint(a) for a in self.addresses])
        profile = build_profiles(load_config(None, "default"))[0]
        self.director = Director(self.store, profile, SaturationDetector(), clock=self.clock)
        self.flow = FlowController(self.director, config, clock=self.clock)
        self.set_state(waiting=0)

    def set_state(
        self, waiting: int = 0, kv: float = 0.0, prefill: int = 0, address: str | None = None
    ) -> None:
        for a in [address] if address else self.addresses:
            self.store.update_metrics(
                a,
                EndpointMetrics(
                    waiting=waiting,
                    kv_usage=kv,
                    prefill_tokens_pending=prefill,
                    kv_blocks_total=1000,
                    updated_at=self.clock.now,
                    sent_at=self.clock.now,
                ),
            )

    def busy(self) -> None:
        self.set_state(waiting=50)

    def idle(self) -> None:
        """A fresh scrape of an idle engine (this replica's own picks confirmed by it)."""
        self.clock.now += 0.1
        self.set_state(waiting=0)


def request(
    tenant: str = "a", prompt: int = 10, priority: int = 0, max_tokens: int = 10, rid: str = ""
) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid or f"{tenant}-{prompt}",
        model="m",
        target_model="m",
        body={"model": "m", "prompt": "x", "max_tokens": max_tokens},
        priority=priority,
        fairness_id=tenant,
        _token_ids=[1] * prompt,
    )


def drain_one(pool: Pool) -> list[Held]:
    """Room for exactly one request: an idle scrape, then a dispatch round."""
    pool.idle()
    sent = pool.flow.dispatch()
    pool.busy()
    return sent


def test_room_means_immediate_dispatch_and_no_room_means_held() -> None:
    pool = Pool()
    first = pool.flow.submit(request("a"))
    assert first.state == "dispatched" and first.decision is not None and first.decision.routed
    assert first.decision.targets == [ENGINE]
    pool.busy()
    second = pool.flow.submit(request("a", rid="second"))
    assert second.state == "queued" and pool.flow.queued == 1
    assert pool.flow.dispatch() == []  # still busy: nothing goes
    sent = drain_one(pool)
    assert sent == [second] and second.state == "dispatched" and pool.flow.queued == 0


def test_strict_priority_bands() -> None:
    pool = Pool(ONE_AT_A_TIME)
    pool.busy()
    low = pool.flow.submit(request("a", priority=0, rid="low"))
    mid = pool.flow.submit(request("b", priority=1, rid="mid"))
    high = pool.flow.submit(request("c", priority=5, rid="high"))
    order = [h for _ in range(3) for h in drain_one(pool)]
    assert order == [high, mid, low]


def test_fifo_inside_a_flow() -> None:
    pool = Pool(ONE_AT_A_TIME)
    pool.busy()
    held = [pool.flow.submit(request("a", rid=f"r{i}")) for i in range(4)]
    order = [h for _ in range(4) for h in drain_one(pool)]
    assert order == held


def test_tokens_not_requests_decide_fairness() -> None:
    """A tenant of huge prompts and one of small prompts, both backlogged: the small one gets
    many dispatches per huge one, so both receive about the same tokens."""
    pool = Pool(ONE_AT_A_TIME)
    pool.busy()
    for i in range(200):
        pool.flow.submit(request("big", prompt=8000, rid=f"big{i}"))
        pool.flow.submit(request("small", prompt=500, rid=f"small{i}"))
    sent = [h for _ in range(100) for h in drain_one(pool)]
    big = sum(h.prompt_tokens for h in sent if h.key.fairness_id == "big")
    small = sum(h.prompt_tokens for h in sent if h.key.fairness_id == "small")
    assert sum(1 for h in sent if h.key.fairness_id == "small") > 4 * sum(
        1 for h in sent if h.key.fairness_id == "big"
    )
    assert 0.6 < big / small < 1.7


def test_weights_divide_service() -> None:
    class Weights:
        def weight(self, name: str) -> float:
            return 3.0 if name == "gold" else 1.0

    pool = Pool(ONE_AT_A_TIME)
    pool.flow.weights = Weights()
    pool.busy()
    for i in range(40):
        pool.flow.submit(request("gold", rid=f"g{i}"))
        pool.flow.submit(request("plain", rid=f"p{i}"))
    sent = [h for _ in range(40) for h in drain_one(pool)]
    gold = sum(1 for h in sent if h.key.fairness_id == "gold")
    assert 28 <= gold <= 32  # 3:1


def test_an_idle_tenant_banks_no_credit() -> None:
    """A tenant that stayed away while another was served does not then get the pool to itself
    for as long as the other was served: it starts from the backlogged floor."""
    pool = Pool(ONE_AT_A_TIME)
    for i in range(50):  # 'old' is served alone for a while
        pool.flow.submit(request("old", rid=f"o{i}"))
    pool.busy()
    for i in range(10):
        pool.flow.submit(request("old", rid=f"late-o{i}"))
        pool.flow.submit(request("new", rid=f"n{i}"))
    sent = [h for _ in range(10) for h in drain_one(pool)]
    assert 3 <= sum(1 for h in sent if h.key.fairness_id == "new") <= 7


def test_short_request_fits_where_a_long_one_does_not() -> None:
    """Room is counted in KV blocks: a nearly full cache still takes a short request."""
    pool = Pool()
    pool.set_state(kv=0.75)  # 50 of 1000 blocks left under the 0.8 threshold
    long = pool.flow.submit(request("a", prompt=2000, max_tokens=10, rid="long"))
    short = pool.flow.submit(request("b", prompt=100, max_tokens=10, rid="short"))
    assert pool.flow.dispatch() == [short]
    assert long.state == "queued" and short.state == "dispatched"


def test_prefill_work_ahead_holds_requests() -> None:
    pool = Pool(FlowControlConfig(dispatch_prefill_tokens=1000))
    pool.set_state(prefill=5000)
    held = pool.flow.submit(request("a"))
    assert held.state == "queued"
    pool.set_state(prefill=100)
    assert pool.flow.dispatch() == [held]


def test_the_pick_is_made_among_endpoints_with_room() -> None:
    pool = Pool(engines=2)
    busy, free = pool.addresses
    pool.set_state(waiting=50, address=busy)
    for i in range(3):
        held = pool.flow.submit(request("a", rid=f"r{i}"))
        assert held.decision is not None and held.decision.targets[0] == free
        pool.idle()
        pool.set_state(waiting=50, address=busy)


def test_stale_metrics_hold_nothing() -> None:
    """With no fresh view of any endpoint, flow control cannot judge room: requests go as
    they would without it, rather than waiting out their TTL."""
    pool = Pool()
    pool.busy()
    pool.clock.now += 60
    held = pool.flow.submit(request("a"))
    assert held.state == "dispatched"


def test_deadline_ends_held_requests_with_a_503() -> None:
    pool = Pool(FlowControlConfig(ttl_s=5))
    pool.busy()
    held = pool.flow.submit(request("a", rid="normal"))
    pool.clock.now += 4
    pool.set_state(waiting=50)
    pool.flow.dispatch()
    assert held.state == "queued"
    pool.clock.now += 2
    pool.set_state(waiting=50)
    pool.flow.dispatch()
    assert held.decision is not None and held.decision.status == 503
    assert held.decision.retry_after == 1 and "TTL" in held.decision.reason  # ceil(5 s / 10)
    assert pool.flow.queued == 0


def test_sheddable_work_is_refused_at_once_without_room() -> None:
    pool = Pool()
    pool.busy()
    shed = pool.flow.submit(request("b", priority=-1, rid="shed"))
    assert shed.decision is not None and shed.decision.status == 429 and "sheddable" in shed.decision.reason
    # saturation is judged anew every scrape: come back in a second, not a tenth of the TTL
    assert shed.decision.retry_after == 1
    assert pool.flow.queued == 0
    pool.idle()
    assert pool.flow.submit(request("b", priority=-1, rid="later")).state == "dispatched"


def test_bounded_queues() -> None:
    pool = Pool(FlowControlConfig(max_queued_per_flow=2, max_queued=3))
    pool.busy()
    a = [pool.flow.submit(request("a", rid=f"a{i}")) for i in range(3)]
    assert [h.state for h in a] == ["queued", "queued", "rejected"]
    assert a[2].decision is not None and a[2].decision.status == 429 and "flow 'a'" in a[2].decision.reason
    b = [pool.flow.submit(request("b", rid=f"b{i}")) for i in range(2)]
    assert b[0].state == "queued" and b[1].state == "rejected"
    assert b[1].decision is not None and b[1].decision.status == 503
    assert pool.flow.queued == 3


def test_the_memory_bound_counts_bodies_and_tokens() -> None:
    pool = Pool(FlowControlConfig(max_queued_bytes=footprint(100, 10) + footprint(100, 10) - 1))
    pool.busy()
    first = pool.flow.submit(request("a", rid="first"), body_bytes=100)
    second = pool.flow.submit(request("b", rid="second"), body_bytes=100)
    assert first.state == "queued" and second.state == "rejected"
    assert second.decision is not None and second.decision.status == 503
    assert pool.flow.queued_bytes == footprint(100, 10)


def test_cancel_removes_and_forgets() -> None:
    pool = Pool()
    pool.busy()
    held = pool.flow.submit(request("a"))
    pool.flow.cancel(held)
    assert held.state == "cancelled" and pool.flow.queued == 0
    assert drain_one(pool) == []


def test_output_estimate_is_corrected_at_the_end() -> None:
    pool = Pool(FlowControlConfig(output_token_weight=2.0, prompt_token_weight=1.0))
    held = pool.flow.submit(request("a", prompt=100, max_tokens=50))
    assert pool.flow.counters["a"] == pytest.approx(100 + 2 * 50)
    pool.flow.completed(held, 10)
    assert pool.flow.counters["a"] == pytest.approx(100 + 2 * 10)


def test_remote_service_counts() -> None:
    pool = Pool(ONE_AT_A_TIME)
    pool.busy()
    pool.flow.note_remote_service("a", 10_000)
    first_b = pool.flow.submit(request("b", rid="b"))
    first_a = pool.flow.submit(request("a", rid="a"))
    assert drain_one(pool) == [first_b]
    assert first_a.state == "queued"


def test_gate_waits_and_cancels() -> None:
    async def scenario() -> None:
        pool = Pool()
        pool.busy()
        gate = FlowGate(pool.flow, tick_s=0.005)
        waiting = asyncio.ensure_future(gate.admit(request("a", rid="w")))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        pool.idle()
        gate.poke()
        held = await asyncio.wait_for(waiting, 2)
        assert held.state == "dispatched"
        pool.busy()
        gone = asyncio.ensure_future(gate.admit(request("a", rid="gone")))
        await asyncio.sleep(0.02)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert pool.flow.queued == 0
        await gate.close()

    asyncio.run(scenario())


def test_held_requests_stay_within_the_memory_they_are_counted_as() -> None:
    """10,000 held requests, each with its body (raw, as the exchange keeps it, and parsed) and
    its prompt tokens: what they take (traced) stays under what --flow-max-queued-bytes counts
    for them, so that bound bounds the EPP's memory. Measured, not timed."""
    count = 10_000
    pool = Pool(FlowControlConfig(max_queued=count, max_queued_per_flow=count))
    pool.busy()
    gc.collect()
    tracemalloc.start()
    kept = []
    for i in range(count):
        body = {"model": "m", "prompt": " ".join(f"w{i}x{k}" for k in range(40)), "max_tokens": 16}
        raw = bytearray(json.dumps(body).encode())
        req = InferenceRequest(
            request_id=f"r{i}",
            model="m",
            target_model="m",
            body=body,
            fairness_id=f"t{i % 50}",
            _token_ids=list(range(1000 + i, 1064 + i)),
        )
        kept.append((raw, pool.flow.submit(req, len(raw))))
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert pool.flow.queued == count and all(h.state == "queued" for _, h in kept)
    assert traced < pool.flow.queued_bytes <= FlowControlConfig().max_queued_bytes
    over = pool.flow.submit(request("x", rid="over"))
    assert over.state == "rejected"
    sent = drain_one(pool)  # what leaves the queue gets its tokens back as a list
    assert sent and sent[0].request.token_ids == list(range(1000, 1064))


def test_a_long_prompt_goes_only_where_no_prompt_work_is_ahead() -> None:
    pool = Pool(FlowControlConfig(dispatch_prefill_tokens=1000))
    pool.set_state(prefill=200)
    assert pool.flow.submit(request("a", prompt=700, rid="fits")).state == "dispatched"
    pool.idle()
    pool.set_state(prefill=200)
    long = pool.flow.submit(request("a", prompt=5000, rid="long"))
    assert long.state == "queued"  # 200 ahead + 5000 > 1000
    pool.idle()
    pool.set_state(prefill=0)
    assert pool.flow.dispatch() == [long]  # nothing ahead: a long prompt may go


def test_a_short_prompt_goes_where_no_prompt_work_is_ahead_when_one_has_none() -> None:
    """Both engines have room for it; the one with a prefill ahead would make it wait."""
    pool = Pool(FlowControlConfig(dispatch_prefill_tokens=1000, short_prompt_tokens=100), engines=2)
    ahead, clear = pool.addresses
    for i in range(3):
        pool.set_state(prefill=300, address=ahead)
        pool.set_state(prefill=0, address=clear)
        held = pool.flow.submit(request("b", prompt=50, rid=f"short{i}"))
        assert held.decision is not None and held.decision.targets == [clear]
        pool.idle()
    # with prompt work ahead everywhere, it still goes where it fits
    pool.set_state(prefill=300)
    assert pool.flow.submit(request("b", prompt=50, rid="short-anyway")).state == "dispatched"


def test_short_reserve_keeps_an_engine_for_short_prompts_while_they_arrive() -> None:
    config = FlowControlConfig(dispatch_prefill_tokens=1000, short_reserve=1, short_prompt_tokens=100)
    pool = Pool(config, engines=3)
    free = pool.addresses[2]
    for address in pool.addresses[:2]:
        pool.set_state(prefill=5000, address=address)
    short = pool.flow.submit(request("b", prompt=50, rid="short"))
    assert short.decision is not None and short.decision.targets == [free]
    pool.idle()
    for address in pool.addresses[:2]:
        pool.set_state(prefill=5000, address=address)
    long = pool.flow.submit(request("a", prompt=2000, rid="long"))
    assert long.state == "queued"  # the one engine without prompt work is kept for short ones
    again = pool.flow.submit(request("c", prompt=50, rid="short-again"))
    pool.flow.dispatch()
    assert again.decision is not None and again.decision.targets == [free]
    pool.clock.now += config.short_window_s + 1  # no short request lately: nothing is kept
    pool.set_state(prefill=0, address=free)
    for address in pool.addresses[:2]:
        pool.set_state(prefill=5000, address=address)
    assert pool.flow.dispatch() == [long]
    assert long.decision is not None and long.decision.targets == [free]


def test_no_reserve_on_a_pool_no_larger_than_it() -> None:
    pool = Pool(FlowControlConfig(short_reserve=1, short_prompt_tokens=100))
    assert pool.flow.submit(request("b", prompt=50, rid="short")).state == "dispatched"
    pool.idle()
    assert pool.flow.submit(request("a", prompt=2000, rid="long")).state == "dispatched"


def test_pool_dispatch_holds_only_while_the_pool_is_saturated_and_picks_among_all() -> None:
    """GIE's default: the saturation detector over the pool gates dispatch, and the pick is the
    profile's among every candidate (one busy engine does not hold work the pool has room for)."""
    pool = Pool(engines=2, dispatch="pool")
    busy, _ = pool.addresses
    pool.set_state(waiting=8, address=busy)  # mean queue 4: below the detector's 5
    assert pool.flow.submit(request("a", rid="goes")).state == "dispatched"
    pool.idle()
    pool.set_state(waiting=50)  # every engine: saturated
    held = pool.flow.submit(request("a", rid="held"))
    assert held.state == "queued"
    shed = pool.flow.submit(request("b", priority=-1, rid="shed"))
    assert shed.decision is not None and shed.decision.status == 429
    pool.idle()
    assert pool.flow.dispatch() == [held]


def test_without_a_tokenizer_prompt_tokens_are_estimated_from_the_prompt() -> None:
    """The EPP loads a tokenizer for flow control; where it cannot, a long prompt must still
    count as long (it was counted as 0 tokens: fairness by requests, long prompts placed as
    short ones)."""
    from kvgate.epp.flow_control import prompt_tokens

    chat = InferenceRequest(
        request_id="r",
        model="m",
        target_model="m",
        body={"model": "m", "messages": [{"role": "user", "content": "word " * 800}]},
    )
    assert 900 <= prompt_tokens(chat) <= 1100
    assert prompt_tokens(request("a", prompt=37)) == 37  # the tokenizer's count when there is one
    pool = Pool()
    held = pool.flow.submit(chat)
    assert held.prompt_tokens == prompt_tokens(chat)


def test_service_taken_while_no_one_else_asked_is_not_held_against_a_tenant() -> None:
    """A light tenant that used an idle pool comes back level with the backlogged tenants
    (within its own next request), not behind a newcomer until it has caught up: without
    that, it waited behind every blocked flow's ceiling."""
    pool = Pool()
    pool.busy()
    pool.flow.counters["b"] = 1_000_000.0  # served a lot while it had the pool to itself
    held_a = pool.flow.submit(request("a", prompt=2000, rid="a0"))
    held_b = pool.flow.submit(request("b", prompt=10, rid="b0"))
    a, b = pool.flow.counters.get("a", 0.0), pool.flow.counters["b"]
    assert a <= b <= a + pool.flow._cost(10, 10)
    pool.idle()
    assert pool.flow.dispatch()[0] is held_a  # the least served goes first
    assert held_b.state == "queued"


def test_a_flow_under_its_share_passes_a_saturated_pool() -> None:
    """Pool dispatch in front of engines that order their queues by tenant service: saturation
    holds the flow that sent most of the recent work, not one that sent less than its share
    (its engine runs it first, so holding it would only add the wait for a gap)."""
    pool = Pool(engines=2, dispatch="pool")
    for i in range(3):
        assert pool.flow.submit(request("heavy", prompt=4000, rid=f"h{i}")).state == "dispatched"
        pool.idle()
    pool.set_state(waiting=10)  # saturated (mean queue 10 >= 5), by the heavy tenant's work
    heavy = pool.flow.submit(request("heavy", prompt=4000, rid="h-held"))
    assert heavy.state == "queued"
    light = pool.flow.submit(request("light", prompt=100, rid="light"))
    assert light.state == "dispatched"
    # a sheddable flow is never under its share: GIE refuses it while the pool is saturated
    shed = pool.flow.submit(request("other", prompt=100, priority=-1, rid="shed"))
    assert shed.decision is not None and shed.decision.status == 429
    # a higher band's flow counts the work of the bands below it
    urgent = pool.flow.submit(request("heavy", prompt=100, priority=1, rid="urgent"))
    assert urgent.state == "dispatched"
    # past fair_share_max_queue (20 waiting per engine) everyone waits, under the EPP's TTL
    pool.set_state(waiting=20)
    assert pool.flow.submit(request("light2", prompt=100, rid="light2")).state == "queued"


def test_a_flow_that_catches_up_with_its_share_is_held_again() -> None:
    pool = Pool(engines=2, dispatch="pool")
    assert pool.flow.submit(request("heavy", prompt=1000, rid="h0")).state == "dispatched"
    pool.idle()
    pool.set_state(waiting=10)
    assert pool.flow.submit(request("heavy", prompt=1000, rid="h1")).state == "queued"
    states = [pool.flow.submit(request("light", prompt=400, rid=f"l{i}")).state for i in range(4)]
    # 1,020 weighted tokens against 420 each: light goes while below half of all the recent
    # work (0 < 510, 420 < 720, 840 < 930), then waits (1,260 > 1,140)
    assert states == ["dispatched", "dispatched", "dispatched", "queued"]


def test_the_recent_work_fades_and_the_rule_can_be_turned_off() -> None:
    pool = Pool(engines=1, dispatch="pool")
    assert pool.flow.submit(request("heavy", prompt=1000, rid="h0")).state == "dispatched"
    pool.clock.now += 30  # three half-lives: an eighth of the heavy tenant's work is left
    pool.set_state(waiting=10)
    assert pool.flow.submit(request("heavy", prompt=1000, rid="h1")).state == "queued"
    # what is left of it lets one light request pass, which is then most of the work
    assert pool.flow.submit(request("light", prompt=1000, rid="l0")).state == "dispatched"
    assert pool.flow.submit(request("light", prompt=1000, rid="l1")).state == "queued"
    pool.clock.now += 200  # twenty more: both forgotten, no one is under a share of nothing
    assert pool.flow.submit(request("other", prompt=10, rid="o0")).state == "queued"
    assert len(pool.flow._recent) == 0
    off = Pool(FlowControlConfig(fair_share_half_life_s=0), engines=1, dispatch="pool")
    assert off.flow.submit(request("heavy", prompt=1000, rid="h0")).state == "dispatched"
    off.idle()
    off.set_state(waiting=10)
    assert off.flow.submit(request("light", prompt=10, rid="l0")).state == "queued"
    off.idle()  # and dispatching with the rule off keeps no record (a half-life of 0)
    assert off.flow.dispatch() and not off.flow._recent


def test_dispatch_marks_a_request_whose_flow_is_over_its_share() -> None:
    """The engines run marked requests after the others of their priority (queue_order)."""
    pool = Pool(engines=2, dispatch="pool")
    first = pool.flow.submit(request("heavy", prompt=4000, rid="h0"))
    assert first.state == "dispatched" and not first.request.over_share  # nobody else yet: at share
    light = pool.flow.submit(request("light", prompt=100, rid="l0"))
    assert not light.request.over_share
    pool.idle()
    again = pool.flow.submit(request("heavy", prompt=4000, rid="h1"))
    # 4,020 of 4,230 weighted tokens against a share of half: over 1.5x of it
    assert again.state == "dispatched" and again.request.over_share
    assert not pool.flow.submit(request("light", prompt=100, rid="l1")).request.over_share

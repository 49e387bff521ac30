"""The waiting order (engine/core/waiting_queue.py) and the scheduler's cap on long prompts,
on the real scheduler and KV cache manager with the simulated runner."""

from __future__ import annotations

import pytest

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request
from kvgate.engine.core.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.core.waiting_queue import WaitingQueue
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner

BS = 4


def _req(rid: str, n: int = 8, t: float = 0.0, tenant: str = "", priority: int = 0, seq: int = 0) -> Request:
    base = 1000 * (hash(rid) % 1000 + 1)
    r = Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=4), arrival_time=t)
    r.tenant, r.priority, r.seq_no = tenant, priority, seq
    return r


def _order(q: WaitingQueue) -> list[str]:
    out = []
    while (r := q.peek()) is not None:
        q.remove(r)
        out.append(r.request_id)
    return out


def test_fcfs_is_arrival_order_and_a_preempted_request_goes_first() -> None:
    q = WaitingQueue("fcfs")
    for i, rid in enumerate(["a", "b", "c"]):
        q.add(_req(rid, t=i, priority=-i, tenant=rid))
    q.add_front(_req("back", t=9))
    assert len(q) == 4 and _order(q) == ["back", "a", "b", "c"]


def test_priority_then_arrival() -> None:
    q = WaitingQueue("priority")
    q.add(_req("late-urgent", t=3, priority=-1))
    q.add(_req("early", t=1))
    q.add(_req("later", t=2))
    q.add(_req("sheddable", t=0, priority=5))
    assert _order(q) == ["late-urgent", "early", "later", "sheddable"]


def test_fair_runs_requests_over_their_tenants_share_after_the_others_of_their_priority() -> None:
    q = WaitingQueue("fair")
    heavy = [_req(f"h{i}", t=i, tenant="heavy", seq=i) for i in range(3)]
    for r in heavy[1:]:
        r.over_share = True  # the EPP's mark: its tenant sent more than its share lately
    for r in heavy:
        q.add(r)
    q.add(_req("light", t=10, tenant="light", seq=10))
    q.add(_req("urgent", t=11, tenant="heavy", priority=-1, seq=11))
    q.add(_req("shed", t=12, tenant="light", priority=1, seq=12))
    # priority first; within it, the unmarked in arrival order, then the marked
    assert _order(q) == ["urgent", "h0", "light", "h1", "h2", "shed"]


def test_without_marks_fair_and_priority_are_arrival_order_within_a_priority() -> None:
    for policy in ("fair", "priority"):
        q = WaitingQueue(policy)
        for i, tenant in enumerate("abcab"):
            q.add(_req(f"{tenant}{i}", t=i, tenant=tenant, seq=i))
        marked = _req("m", t=-1, tenant="a", seq=99)
        marked.over_share = True
        q.add(marked)
        expected = (
            ["a0", "b1", "c2", "a3", "b4", "m"] if policy == "fair" else ["m", "a0", "b1", "c2", "a3", "b4"]
        )
        assert _order(q) == expected, policy


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="fcfs, priority, fair"):
        WaitingQueue("lifo")


def _sched(threshold: int, budget: int = 64, policy: str = "fair") -> tuple[Scheduler, SimulatedRunner]:
    kv = KVCacheManager(256, BS)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=budget,
            max_model_len=1024,
            scheduling_policy=policy,
            long_prefill_token_threshold=threshold,
            long_prefill_step_tokens=threshold,
        ),
        kv,
    )
    runner = SimulatedRunner(
        EngineConfig(block_size=BS, num_kv_blocks=256, simulation=SimulationConfig(time_scale=0))
    )
    return sched, runner


def _step(sched: Scheduler, runner: SimulatedRunner) -> dict[str, int]:
    batch = sched.schedule()
    sched.update(batch, runner.execute(batch) if batch.seqs else [])
    return {s.request_id: len(s.token_ids) for s in batch.seqs}


def test_a_long_prompt_gets_the_threshold_while_short_ones_arrive_and_they_go_before_it() -> None:
    sched, runner = _sched(threshold=16)
    sched.add_request(_req("long", n=200, t=0, tenant="a"))
    sched.add_request(_req("short0", n=8, t=0.5, tenant="b", seq=1))  # short traffic: the cap holds
    assert _step(sched, runner) == {"long": 16, "short0": 8}  # arrival order; the long one capped
    assert _step(sched, runner) == {"short0": 1, "long": 16}
    sched.add_request(_req("short1", n=12, t=1.0, tenant="b", seq=2))
    # the new short prompt goes before the long one's next piece, which gets a block
    assert _step(sched, runner) == {"short0": 1, "short1": 12, "long": BS}


def test_long_prompts_alone_use_the_whole_budget() -> None:
    sched, runner = _sched(threshold=16)
    sched.add_request(_req("long", n=200, t=0, tenant="a"))
    assert _step(sched, runner) == {"long": 64}
    off, runner = _sched(threshold=0)
    off.add_request(_req("long", n=200, t=0, tenant="a"))
    off.add_request(_req("short", n=8, t=0, tenant="b", seq=1))
    assert _step(off, runner) == {"long": 64}  # no cap: the long one takes the budget


def test_one_long_prompt_per_tenant_in_prefill_while_the_cap_holds() -> None:
    sched, runner = _sched(threshold=16, budget=256)
    for i in range(3):
        sched.add_request(_req(f"a{i}", n=100, t=i, tenant="a", seq=i))
    sched.add_request(_req("b0", n=100, t=5, tenant="b", seq=5))
    sched.add_request(_req("s", n=4, t=6, tenant="c", seq=6))  # short traffic
    first = _step(sched, runner)
    # the short prompt in full, then one long prompt per tenant in what is left of 16
    assert first["s"] == 4 and set(first) <= {"s", "a0", "b0"}
    second = _step(sched, runner)
    assert "a1" not in second and "a2" not in second


def test_a_lower_prioritys_long_prompt_gets_a_block_a_step_while_more_urgent_short_ones_arrive() -> None:
    sched, runner = _sched(threshold=32, budget=256, policy="priority")
    sched.add_request(_req("flood", n=400, t=0, priority=1))  # sheddable-like: after priority 0
    assert _step(sched, runner) == {"flood": 256}  # alone: the whole budget
    sched.add_request(_req("urgent", n=8, t=1, priority=0, seq=1))
    assert _step(sched, runner) == {"urgent": 8, "flood": BS}  # one block beside it
    sched.add_request(_req("peer", n=8, t=2, priority=1, seq=2))
    # a short one of its own priority does not shrink it further: the urgent one's window holds
    assert _step(sched, runner)["flood"] == BS


def test_the_block_a_step_ends_with_the_last_more_urgent_short_request() -> None:
    """Not an arrival window: a priority-1 request every few seconds held every lower-priority
    long prompt at a block a step for good (through the processes, 20% of the pool's output for
    the 10 s after a priority-1 burst)."""
    sched, runner = _sched(threshold=32, budget=256, policy="priority")
    sched.add_request(_req("flood", n=2000, t=0, priority=1))
    sched.add_request(_req("urgent", n=8, t=1, priority=0, seq=1))  # 4 tokens to answer
    pieces = []
    while "urgent" in sched.requests:
        pieces.append(_step(sched, runner)["flood"])
    assert pieces and set(pieces) == {BS}  # one block beside it, each step it was here
    # within the arrival window still (short traffic came 1 s ago): the cap, not a block
    assert _step(sched, runner)["flood"] == 32
    sched.add_request(_req("again", n=8, t=1.5, priority=0, seq=2))
    assert _step(sched, runner)["flood"] == BS
    sched.abort_request("again")  # an abort ends it too
    assert _step(sched, runner)["flood"] == 32
    assert not sched._live_short and not sched._short_ids  # nothing kept for finished requests

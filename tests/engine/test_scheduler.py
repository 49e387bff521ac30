"""Scheduler: token budget, chunked prefill, running first, max_num_seqs, preemption, abort."""

from __future__ import annotations

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request, RequestStatus
from kvgate.engine.core.runner_api import ScheduledBatch
from kvgate.engine.core.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner

BS = 4


def _setup(
    num_blocks: int = 64, max_tokens: int = 32, max_seqs: int = 8, chunked: bool = True
) -> tuple[Scheduler, SimulatedRunner]:
    kv = KVCacheManager(num_blocks, BS)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            max_model_len=256,
            enable_chunked_prefill=chunked,
        ),
        kv,
    )
    runner = SimulatedRunner(
        EngineConfig(block_size=BS, num_kv_blocks=num_blocks, simulation=SimulationConfig(time_scale=0))
    )
    return sched, runner


def _add(
    sched: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, t: float = 0.0, priority: int = 0
) -> Request:
    base = 1000 * (sched._next_seq_no + 1)  # distinct prompts: no accidental prefix hits
    req = Request(
        rid,
        [base + i for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens),
        arrival_time=t,
        priority=priority,
    )
    sched.add_request(req)
    return req


def _step(sched: Scheduler, runner: SimulatedRunner) -> ScheduledBatch:
    batch = sched.schedule()
    sched.update(batch, runner.execute(batch) if batch.seqs else [])
    return batch


def _drain(sched: Scheduler, runner: SimulatedRunner, limit: int = 1000) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        _step(sched, runner)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def test_token_budget_and_chunked_prefill() -> None:
    sched, runner = _setup(max_tokens=16)
    req = _add(sched, "a", 40)
    sizes = []
    while req.num_output_tokens == 0:
        batch = _step(sched, runner)
        assert batch.num_tokens <= 16
        sizes.append([(s.start_pos, len(s.token_ids), s.sample) for s in batch.seqs])
    assert sizes == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    batch = _step(sched, runner)
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in batch.seqs] == [(40, 1, True)]
    assert batch.seqs[0].token_ids == [req.output_token_ids[0]]
    assert batch.seqs[0].block_table == req.block_ids and len(req.block_ids) == 11


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched, runner = _setup(max_tokens=16, chunked=False)
    _add(sched, "a", 10, max_tokens=3)
    _add(sched, "b", 10, max_tokens=3)
    batch = _step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 10)]
    batch = _step(sched, runner)  # a decodes (1) and b's 10 tokens fit in the rest
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 10)]


def test_running_requests_go_first_then_waiting_in_order() -> None:
    sched, runner = _setup(max_tokens=20)
    _add(sched, "a", 6, max_tokens=10)
    _add(sched, "b", 6, max_tokens=10)
    _step(sched, runner)
    _add(sched, "c", 30, max_tokens=10)
    batch = _step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 1), ("c", 18)]
    batch = _step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 1), ("c", 12)]
    assert batch.seqs[2].sample


def test_max_num_seqs_caps_the_batch() -> None:
    sched, runner = _setup(max_tokens=100, max_seqs=2)
    for rid in "abc":
        _add(sched, rid, 5, max_tokens=3)
    batch = _step(sched, runner)
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and sched.num_waiting == 1
    _drain(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preemption_recomputes_the_newest_and_everything_finishes_without_leaks() -> None:
    # 8 blocks of 4 = 32 tokens; four requests each wanting 8 + 12 = 20 tokens.
    sched, runner = _setup(num_blocks=8, max_tokens=64)
    reqs = [_add(sched, f"r{i}", 8, max_tokens=12, t=float(i)) for i in range(4)]
    _drain(sched, runner)
    assert sched.num_preemptions_total > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 12 for r in reqs)
    assert any(r.num_preemptions for r in reqs)
    assert reqs[0].num_preemptions == 0  # the oldest is never the victim while others run
    assert sched.kv.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_preempted_request_goes_back_to_the_front_of_the_queue() -> None:
    sched, runner = _setup(num_blocks=4, max_tokens=64)
    a = _add(sched, "a", 8, max_tokens=8, t=0.0)
    b = _add(sched, "b", 8, max_tokens=8, t=1.0)
    c = _add(sched, "c", 3, max_tokens=1, t=2.0)
    _step(sched, runner)  # a and b admitted: 2 blocks each; c waits for room
    assert sched.num_running == 2 and list(sched.waiting) == [c]
    _step(sched, runner)  # both need a 3rd block: b (newest) is preempted
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b, c]
    assert b.num_computed_tokens == 0 and b.block_ids == []
    _drain(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_abort_waiting_running_and_mid_prefill_frees_blocks() -> None:
    sched, runner = _setup(max_tokens=8)
    a = _add(sched, "a", 20)
    b = _add(sched, "b", 4)
    _step(sched, runner)  # a: first 8 tokens of its prompt
    assert a.status == RequestStatus.RUNNING and 0 < a.num_computed_tokens < a.num_prompt_tokens
    assert sched.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert sched.abort_request("a") is None
    assert b.status == RequestStatus.WAITING
    sched.abort_request("b")
    assert b.status == RequestStatus.FINISHED_ABORTED
    c = _add(sched, "c", 3, max_tokens=50)
    assert sorted(_step(sched, runner).finished_request_ids) == ["a", "b"]
    _step(sched, runner)
    assert c.num_output_tokens == 2
    sched.abort_request("c")
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    batch = _step(sched, runner)  # nothing to run: the finished ids wait for a real batch
    assert batch.seqs == []
    _add(sched, "d", 3, max_tokens=1)
    assert _step(sched, runner).finished_request_ids == ["c"]


def test_stop_on_eos_stop_token_and_max_model_len() -> None:
    sched, runner = _setup()
    probe = _add(sched, "probe", 4, max_tokens=3)
    _drain(sched, runner)
    t0, t1 = probe.output_token_ids[:2]
    eos = Request("eos", probe.prompt_token_ids, SamplingParams(max_tokens=3), eos_token_ids=frozenset({t1}))
    # Same request id → same simulated tokens as the probe.
    eos.request_id = "probe"
    sched.add_request(eos)
    _drain(sched, runner)
    assert eos.output_token_ids == [t0, t1] and eos.status == RequestStatus.FINISHED_STOPPED
    assert eos.stop_reason is None
    ign = Request(
        "probe",
        probe.prompt_token_ids,
        SamplingParams(max_tokens=3, ignore_eos=True),
        eos_token_ids=frozenset({t1}),
    )
    sched.add_request(ign)
    _drain(sched, runner)
    assert ign.num_output_tokens == 3 and ign.status == RequestStatus.FINISHED_LENGTH
    stop = Request("probe", probe.prompt_token_ids, SamplingParams(max_tokens=3, stop_token_ids=[t0]))
    sched.add_request(stop)
    _drain(sched, runner)
    assert stop.output_token_ids == [t0] and stop.stop_reason == t0
    mint = Request(
        "probe", probe.prompt_token_ids, SamplingParams(max_tokens=3, stop_token_ids=[t0], min_tokens=2)
    )
    sched.add_request(mint)
    _drain(sched, runner)
    assert mint.num_output_tokens == 3
    long = Request("long", [1] * 250, SamplingParams(max_tokens=None))
    sched.add_request(long)
    _drain(sched, runner)
    assert long.num_tokens == 256 and long.status == RequestStatus.FINISHED_LENGTH


def test_pending_prefill_tokens_counts_queued_and_running_prefill_less_cache_hits() -> None:
    """What kvgate:prefill_tokens_pending exports (a router's latency estimate reads it)."""
    sched, runner = _setup(max_tokens=32)
    first = _add(sched, "a", 40)
    assert sched.pending_prefill_tokens() == 40
    _step(sched, runner)  # 32 of a's 40 computed, the rest in the next step
    assert sched.pending_prefill_tokens() == 8
    _drain(sched, runner)
    assert sched.pending_prefill_tokens() == 0
    # the same prompt again: 9 of its 10 blocks are cached and are no work (the block holding
    # the last token is computed again, so the model has something to sample from)
    again = Request("b", list(first.prompt_token_ids), SamplingParams(max_tokens=4))
    sched.add_request(again)
    assert sched.pending_prefill_tokens() == 40 - again.expected_cached_tokens
    assert again.expected_cached_tokens == 36


def test_pending_prefill_tokens_counts_the_step_in_flight() -> None:
    """Read between schedule and update (a step running), the prompt tokens that step computes
    are still ahead of a new request: without them an engine on the last chunk of a long
    prompt would look idle for that whole step."""
    sched, runner = _setup(max_tokens=32)
    _add(sched, "a", 40)
    _add(sched, "d", 4)
    _step(sched, runner)  # a: 32 computed; d waits (no budget)
    batch = sched.schedule()  # a's last 8 and d's 4 in flight
    assert sched.in_flight_prefill_tokens == 12
    assert sched.pending_prefill_tokens() == 12
    sched.update(batch, runner.execute(batch))
    assert sched.in_flight_prefill_tokens == 0
    assert sched.pending_prefill_tokens() == 0
    batch = sched.schedule()  # decodes only: no prompt tokens in flight
    assert sched.in_flight_prefill_tokens == 0


def _add_ranked(sched: Scheduler, rid: str, priority: int, n_prompt: int = 5, max_tokens: int = 6) -> Request:
    return _add(sched, rid, n_prompt, max_tokens=max_tokens, t=float(sched._next_seq_no), priority=priority)


def _fair(num_blocks: int = 64, max_seqs: int = 2, policy: str = "fair") -> tuple[Scheduler, SimulatedRunner]:
    sched, runner = _setup(num_blocks=num_blocks, max_tokens=100, max_seqs=max_seqs)
    sched.config.scheduling_policy = policy
    sched.waiting = type(sched.waiting)(policy)
    return sched, runner


def test_a_waiting_request_preempts_running_work_of_a_lower_priority_for_a_slot() -> None:
    sched, runner = _fair()
    old, new = _add_ranked(sched, "batch-old", 1), _add_ranked(sched, "batch-new", 1)
    _step(sched, runner)
    _step(sched, runner)
    assert sched.num_running == 2 and new.num_output_tokens == 2
    urgent = _add_ranked(sched, "online", 0)
    batch = _step(sched, runner)
    # The newest of the lower priority gave its slot at once; the oldest decodes on.
    assert {s.request_id for s in batch.seqs} == {"batch-old", "online"}
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == [] and sched.num_preemptions_total == 1
    assert urgent.num_output_tokens == 1
    _drain(sched, runner)
    assert [r.num_output_tokens for r in (old, new, urgent)] == [6, 6, 6]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_the_preempted_request_resumes_with_the_same_output() -> None:
    def run(urgent_arrives: bool) -> list[int]:
        sched, runner = _fair(max_seqs=1)
        victim = _add_ranked(sched, "batch", 1, max_tokens=10)
        for _ in range(4):
            _step(sched, runner)
        if urgent_arrives:
            _add_ranked(sched, "online", -3)
        _drain(sched, runner)
        assert victim.num_preemptions == int(urgent_arrives)
        return victim.output_token_ids

    assert run(True) == run(False)


def test_equal_priorities_and_fcfs_never_preempt_for_a_slot() -> None:
    for policy, priorities in (("fair", (0, 0)), ("priority", (2, 2)), ("fcfs", (1, 0))):
        sched, runner = _fair(policy=policy)
        _add_ranked(sched, "a", priorities[0])
        _add_ranked(sched, "b", priorities[0])
        _step(sched, runner)
        late = _add_ranked(sched, "c", priorities[1])
        _step(sched, runner)
        assert sched.num_preemptions_total == 0 and late.status == RequestStatus.WAITING, policy


def test_a_waiting_request_preempts_lower_priority_work_for_blocks() -> None:
    # 6 blocks of 4: the batch request holds 4 (13 tokens of prompt + output); the urgent one
    # needs 3 of the 2 left and only a preemption makes room. A free slot does not suffice.
    sched, runner = _fair(num_blocks=6, max_seqs=4)
    batch_req = _add_ranked(sched, "batch", 5, n_prompt=13, max_tokens=8)
    _step(sched, runner)
    assert len(batch_req.block_ids) == 4
    urgent = _add_ranked(sched, "online", 0, n_prompt=10)
    batch = _step(sched, runner)
    assert [s.request_id for s in batch.seqs] == ["online"]
    assert batch_req.status == RequestStatus.PREEMPTED
    _drain(sched, runner)
    assert urgent.num_output_tokens == 6 and batch_req.num_output_tokens == 8


def test_only_the_room_the_urgent_requests_need_is_taken() -> None:
    # Four batch requests run, two online ones arrive: two preemptions, not four.
    sched, runner = _fair(max_seqs=4)
    batch = [_add_ranked(sched, f"b{i}", 1, max_tokens=20) for i in range(4)]
    _step(sched, runner)
    _add_ranked(sched, "o1", 0)
    _add_ranked(sched, "o2", 0)
    _step(sched, runner)
    assert sched.num_preemptions_total == 2 and sched.num_running == 4
    assert [r.status for r in batch] == [RequestStatus.RUNNING] * 2 + [RequestStatus.PREEMPTED] * 2


def test_sheddable_load_counts_the_lower_priority_part_and_none_under_fcfs() -> None:
    sched, runner = _fair(max_seqs=2)
    _add_ranked(sched, "online", 0, n_prompt=8)
    _add_ranked(sched, "batch", 1, n_prompt=8)
    _add_ranked(sched, "batch-2", 2, n_prompt=12)
    assert sched.sheddable_load() == (0, 2, 20)
    _step(sched, runner)  # online and batch run, batch-2 waits
    assert sched.sheddable_load() == (1, 1, 12)
    assert sched.pending_prefill_tokens() == 12
    fcfs, _ = _fair(policy="fcfs")
    _add_ranked(fcfs, "x", 1)
    assert fcfs.sheddable_load() == (0, 0, 0)


def test_no_preemption_for_a_long_prompt_that_would_wait_for_its_tenants_long_one_anyway() -> None:
    """Long prompts of a tenant prefill one at a time (max_long_partial_prefills): a second one
    is passed over in pass 2, so preempting a batch line for it would only have the line take
    its slot back. It preempts once the first has finished its prefill."""
    sched, runner = _fair(max_seqs=3)
    cfg = sched.config
    cfg.long_prefill_token_threshold, cfg.long_prefill_step_tokens = 8, 8
    cfg.max_long_partial_prefills, cfg.short_prompt_window_s = 1, 1e9
    _add_ranked(sched, "short", 0, n_prompt=4, max_tokens=60)  # keeps the long-prompt cap on
    first = _add_ranked(sched, "long-1", 0, n_prompt=40, max_tokens=60)
    _add_ranked(sched, "batch", 1, max_tokens=60)
    _step(sched, runner)
    assert sched.num_running == 3 and first.num_computed_tokens < 40
    second = _add_ranked(sched, "long-2", 0, n_prompt=40)
    _step(sched, runner)
    assert sched.num_preemptions_total == 0 and second.status == RequestStatus.WAITING
    while first.num_computed_tokens < 40:
        _step(sched, runner)
    _step(sched, runner)
    assert sched.num_preemptions_total == 1 and second.status == RequestStatus.RUNNING

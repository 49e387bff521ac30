"""The host KV tier under the prefix cache: what reaches it and when, what a hit loads, which
copies a step carries, its KV events (medium "CPU"), and that no slot a load still reads is
reused. The real model's check (a CPU-tier hit gives exactly the tokens of a fresh compute) is
in test_llm_engine_real.py; the simulated engine's end to end at the bottom here."""

from __future__ import annotations

import pytest

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.kv_cache_manager import KVCacheManager, OffloadOn
from kvgate.engine.core.request import Request
from kvgate.engine.core.runner_api import ScheduledBatch
from kvgate.engine.core.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner

BS = 4


def _req(rid: str, tokens: list[int], lora_id: int | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), lora_id=lora_id)


def _sched(gpu_blocks: int, host_blocks: int, offload_on: OffloadOn = "evict") -> Scheduler:
    kv = KVCacheManager(gpu_blocks, BS, host_blocks=host_blocks, offload_on=offload_on)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)


def _finish_prefill(sched: Scheduler, request: Request) -> list[ScheduledBatch]:
    """Schedule until the request's prompt is computed, then end it; returns the batches."""
    sched.add_request(request)
    batches = []
    while not request.is_finished:
        batch = sched.schedule()
        batches.append(batch)
        sched.finish_request(request, request.status.FINISHED_STOPPED)
    return batches


def _stored(events: list[KVEvent], medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes]


def _removed(events: list[KVEvent], medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


A = list(range(100, 117))  # 4 full blocks + 1 token
B = list(range(200, 217))


def test_evicted_blocks_go_to_the_host_and_a_hit_loads_them_instead_of_computing() -> None:
    sched = _sched(gpu_blocks=5, host_blocks=8)
    kv = sched.kv
    (first,) = _finish_prefill(sched, _req("a", A))
    assert not first.kv_saves and not first.kv_loads  # nothing evicted yet
    a_hashes = list(sched.kv.pool._cached)
    kv.drain_events()

    # B needs all 5 device blocks: A's 4 cached ones are evicted, saved to the host on the way.
    (b_batch,) = _finish_prefill(sched, _req("b", B))
    assert len(b_batch.kv_saves) == 4 and not b_batch.kv_loads
    assert {block for block, _ in b_batch.kv_saves} <= set(b_batch.seqs[0].block_table)
    events = kv.drain_events()
    assert sorted(_stored(events, "CPU")) == sorted(a_hashes)
    assert sorted(_removed(events, "GPU")) == sorted(a_hashes)
    # the host tier's events come before the device's removals: a subscriber never loses a block
    # it could still serve
    first_cpu = next(i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == "CPU")
    first_gone = next(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))
    assert first_cpu < first_gone
    cpu_event = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
    assert cpu_event.block_size == BS and len(cpu_event.token_ids) == BS

    # A again: a miss on the device, 4 blocks found on the host, loaded, 1 token computed.
    again = _req("a2", A)
    sched.add_request(again)
    assert again.expected_cached_tokens == 16
    batch = sched.schedule()
    (seq,) = batch.seqs
    assert seq.start_pos == 16 and len(seq.token_ids) == 1
    saved_slots = {slot for _, slot in b_batch.kv_saves}
    assert len(batch.kv_loads) == 4
    assert {slot for _, slot in batch.kv_loads} == saved_slots
    assert [block for block, _ in batch.kv_loads] == seq.block_table[:4]
    assert again.num_cached_tokens == 16 and again.num_host_cached_tokens == 16
    assert kv.host_cache_hits == 16 and kv.prefix_cache_hits == 0
    # loaded blocks are findable on the device again (BlockStored, medium GPU)
    assert sorted(_stored(kv.drain_events(), "GPU")) == sorted(a_hashes)


def test_compute_policy_copies_each_block_after_the_step_that_computes_it() -> None:
    sched = _sched(gpu_blocks=5, host_blocks=8, offload_on="compute")
    (first,) = _finish_prefill(sched, _req("a", A))
    assert not first.kv_saves and not first.kv_loads
    assert [block for block, _ in first.kv_saves_after] == first.seqs[0].block_table[:4]
    assert len(_stored(sched.kv.drain_events(), "CPU")) == 4
    # Evicting them later costs no copy: the host already has them.
    (b_batch,) = _finish_prefill(sched, _req("b", B))
    assert not b_batch.kv_saves and len(b_batch.kv_saves_after) == 4
    again = _req("a2", A)
    sched.add_request(again)
    batch = sched.schedule()
    assert len(batch.kv_loads) == 4 and again.num_host_cached_tokens == 16


def test_a_slot_a_load_reads_is_not_reused_by_a_save_of_the_same_step() -> None:
    # A host tier of 4 blocks holds A. In one step, A2 loads them and C's allocation evicts
    # B's blocks, whose saves need host slots: the only unpinned slots there are none, so
    # those saves are dropped rather than written over what the loads read.
    sched = _sched(gpu_blocks=10, host_blocks=4)
    kv = sched.kv
    _finish_prefill(sched, _req("a", A))
    _finish_prefill(sched, _req("b", B))  # 5 + 5 blocks: the device is full of A and B
    fill = _req("fill", list(range(300, 337)))  # 9 full blocks + 1: evicts A (4) and B (4)
    _finish_prefill(sched, fill)
    assert kv.host.num_cached_blocks == 4
    held = set(kv.host._blocks)
    kv.drain_events()
    # Now load whichever prompt the host holds, while a request of 5 new blocks evicts more.
    b_hashes = Request("x", list(B), SamplingParams())
    kv._extend_hashes(b_hashes, 16)
    prompt = B if set(b_hashes.block_hashes) == held else A
    loader = _req("loader", prompt)
    other = _req("other", list(range(400, 417)))
    sched.add_request(loader)
    sched.add_request(other)
    batch = sched.schedule()
    assert len(batch.kv_loads) == 4
    loaded_slots = {slot for _, slot in batch.kv_loads}
    assert not loaded_slots & {slot for _, slot in batch.kv_saves}
    # after the step the pins go, and the next step's saves may use those slots again
    kv.begin_step()
    assert all(b.pins == 0 for b in kv.host._blocks.values())
    kv.end_step()


def test_changed_adapter_drops_its_blocks_from_both_tiers_and_reset_clears_the_host() -> None:
    sched = _sched(gpu_blocks=5, host_blocks=8)
    kv = sched.kv
    _finish_prefill(sched, _req("a", A, lora_id=7))
    _finish_prefill(sched, _req("b", B))  # evicts A's blocks to the host
    assert kv.host.num_cached_blocks == 4
    kv.drain_events()
    assert kv.forget_lora(7, []) == 4
    assert len(_removed(kv.drain_events(), "CPU")) == 4
    again = _req("a2", A, lora_id=7)
    assert kv.get_computed_blocks(again).num_tokens == 0
    _finish_prefill(sched, _req("c", list(range(500, 517))))  # evicts B's to the host
    assert kv.host.num_cached_blocks == 4
    kv.reset_prefix_cache()
    assert kv.host.num_cached_blocks == 0
    assert any(isinstance(e, AllBlocksCleared) for e in kv.drain_events())
    assert kv.get_computed_blocks(_req("b2", B)).num_tokens == 0


def test_no_host_tier_means_no_copies_and_the_old_hit_shape() -> None:
    sched = _sched(gpu_blocks=5, host_blocks=0)
    assert sched.kv.host is None
    _finish_prefill(sched, _req("a", A))
    (b_batch,) = _finish_prefill(sched, _req("b", B))
    assert not (b_batch.kv_saves or b_batch.kv_loads or b_batch.kv_saves_after)
    assert all(e.medium == "GPU" for e in sched.kv.drain_events() if isinstance(e, BlockStored))


@pytest.mark.parametrize("offload_on", ["evict", "compute"])
def test_simulated_engine_serves_an_evicted_prompt_from_the_host_with_the_same_tokens(
    offload_on: str,
) -> None:
    config = EngineConfig(
        simulate=True,
        block_size=BS,
        max_model_len=64,
        num_kv_blocks=5,
        kv_offload_on=offload_on,
        simulation=SimulationConfig(time_scale=0.0, cpu_kv_blocks=16),
    )
    engine = LLMEngine(config, tokenizer=None, runner=SimulatedRunner(config))
    assert engine.kv.host is not None and engine.kv.host.num_blocks == 16

    def run(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True, seed=5))
        while True:
            for out in engine.step():
                if out.finished:
                    return out.token_ids, out.num_cached_tokens

    first, cached = run("a", A)
    assert cached == 0
    run("b", B)  # evicts all of A from the 5-block device pool
    second, cached = run("a2", A)
    assert second == first and cached == 16
    stats = engine.get_stats()
    assert stats.host_cache_hits_total == 16 and stats.host_kv_loads_total == 4
    assert stats.host_kv_stores_total >= 4
    runner = engine.runner
    assert isinstance(runner, SimulatedRunner) and runner.kv_blocks_copied >= 8

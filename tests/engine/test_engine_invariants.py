"""Random workloads (shared prefixes, tiny pools, aborts at random points) keep every invariant.

After each step: block reference counts equal the number of requests holding each block, the
free queue holds exactly the unreferenced blocks, the prefix-cache map and the blocks agree,
and the KV events replayed by a subscriber describe exactly the cached set. At the end nothing
leaks, and each finished request produced the tokens it would have produced alone.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimulatedRunner

BS = 4
VOCAB = 512


class _Tok:
    """Enough of a tokenizer for the engine: every id renders as a short word."""

    eos_token_ids: set[int] = set()  # noqa: RUF012

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" w{i}" for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {f"Ġw{i}": i for i in range(VOCAB)}


def _check(engine: LLMEngine, cached_by_events: set[int]) -> None:
    kv = engine.kv
    pool = kv.pool
    holders: Counter[int] = Counter()
    for rid in engine.scheduler.requests:
        for block in kv._blocks.get(rid, []):
            holders[block.block_id] += 1
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id]
        assert pool.is_free(block) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert pool._cached[block.block_hash] is block
    assert len(pool._cached) == sum(b.block_hash is not None for b in pool.blocks)
    assert set(pool._cached) == cached_by_events
    for req in engine.scheduler.requests.values():
        assert req.block_ids == [b.block_id for b in kv._blocks.get(req.request_id, [])]
        assert len(req.block_ids) * BS >= req.num_computed_tokens


def _replay(events: list[Any], cached: set[int]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == len(ev.block_hashes) * BS
            assert ev.parent_block_hash is None or ev.parent_block_hash in cached
            assert not cached.intersection(ev.block_hashes)
            cached.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert cached.issuperset(ev.block_hashes)
            cached.difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            cached.clear()


request_st = st.tuples(
    st.integers(0, 3),  # which shared prefix
    st.integers(0, 3 * BS),  # its length
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2 * BS),  # own suffix
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # abort after this many steps (6 = never)
)


# Derandomized: the same 60 workloads every run, so CI never flakes on a new random draw.
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=10),
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 6),
    chunked=st.booleans(),
    reset_at=st.integers(0, 30),
)
def test_random_workloads_keep_invariants(
    requests: list[tuple[int, int, list[int], int, int]],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    chunked: bool,
    reset_at: int,
) -> None:
    cfg = EngineConfig(
        simulate=True,
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        simulation=SimulationConfig(time_scale=0, vocab_size=VOCAB),
    )
    tok = _Tok()
    engine = LLMEngine(cfg, runner=SimulatedRunner(cfg, tok), tokenizer=tok)
    prefixes = [[(p * 37 + i) % VOCAB for i in range(3 * BS)] for p in range(4)]
    aborts: dict[str, int] = {}
    expected_len: dict[str, int] = {}
    for i, (p, plen, suffix, max_tokens, abort_after) in enumerate(requests):
        prompt = (prefixes[p][:plen] + suffix)[: engine.max_model_len - 1]
        rid = f"r{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        expected_len[rid] = min(max_tokens, engine.max_model_len - len(prompt))
        if abort_after < 6:
            aborts[rid] = abort_after
    cached: set[int] = set()
    finished: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for rid, when in aborts.items():
            if when == step:
                engine.abort_request(rid)
        if step == reset_at:
            engine.reset_prefix_cache()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        _replay(engine.drain_kv_events(), cached)
        _check(engine, cached)
        step += 1
        assert step < 2000, "no progress"
    assert engine.kv.num_free_blocks == num_blocks
    assert engine.get_stats().kv_cache_usage == 0.0
    alone = SimulatedRunner(cfg, tok)
    for rid, tokens in finished.items():
        assert len(tokens) == expected_len[rid]
        # The simulated token at output position k depends only on (request id, k).
        assert tokens == _solo_tokens(alone, rid, len(tokens))
    assert set(finished) | set(aborts) >= {f"r{i}" for i in range(len(requests))}


def _solo_tokens(runner: SimulatedRunner, rid: str, n: int) -> list[int]:
    from kvgate.engine.core.runner_api import ScheduledBatch, ScheduledSeq

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    out = []
    for k in range(n):
        seq = ScheduledSeq(rid, [0], k, [], True, params, num_generated=k)
        out.append(runner.execute(ScheduledBatch([seq]))[0].token_id)
    return out

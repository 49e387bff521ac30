"""Block pool and KV cache manager: ref counts, LRU eviction, hash chains, KV events, no leaks."""

from __future__ import annotations

import pytest

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.engine.core.block_pool import BlockPool, hash_block_tokens
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request
from kvgate.engine.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], lora_id: int | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), lora_id=lora_id)


def _prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit `req` the way the scheduler does and mark its whole prompt computed."""
    hits, num_hit, _ = kv.get_computed_blocks(req)
    assert kv.allocate(req, req.num_tokens - num_hit, hits, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req, req.num_tokens)
    return num_hit


def test_hash_chain_is_stable_and_depends_on_parent_and_extra_key() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert 0 <= a < 2**64
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8])
    assert b != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_key=7) != a
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_key=7) != hash_block_tokens(
        None, [1, 2, 3, 4], extra_key=8
    )


def test_same_prefix_gives_same_hashes_and_a_different_prefix_does_not() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    r1 = _req("a", [*range(12), 99])
    r2 = _req("b", [*range(12), 42, 43])
    r3 = _req("c", [100, *range(1, 12), 99])
    for r in (r1, r2, r3):
        kv.get_computed_blocks(r)
    assert r1.block_hashes == r2.block_hashes and len(r1.block_hashes) == 3
    assert all(h1 != h3 for h1, h3 in zip(r1.block_hashes, r3.block_hashes, strict=True))


def test_allocation_ref_counts_and_no_leak() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r1 = _req("a", list(range(10)))  # 3 blocks
    assert _prefill(kv, r1) == 0
    assert kv.num_free_blocks == 5 and len(r1.block_ids) == 3
    r2 = _req("b", list(range(10)))
    # Both full blocks are cached; the partial third is r2's own.
    assert _prefill(kv, r2) == 8
    assert r2.block_ids[:2] == r1.block_ids[:2] and r2.block_ids[2] != r1.block_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in r1.block_ids[:2]] == [2, 2]
    assert kv.num_free_blocks == 4
    kv.free(r1)
    assert [kv.pool.blocks[i].ref_cnt for i in r2.block_ids[:2]] == [1, 1]
    kv.free(r2)
    assert kv.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.usage() == 0.0


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly two full blocks
    _prefill(kv, _req("a", tokens))
    r2 = _req("b", tokens)
    hits, n, _ = kv.get_computed_blocks(r2)
    assert n == 4 and len(hits) == 1  # the last token must still be computed


def test_counters_are_in_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    _prefill(kv, _req("a", list(range(13))))
    _prefill(kv, _req("b", list(range(13))))
    assert kv.prefix_cache_queries == 26
    assert kv.prefix_cache_hits == 12


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    r1 = _req("a", list(range(8)))
    _prefill(kv, r1)
    r2 = _req("b", list(range(100, 112)))  # needs 3 blocks, 1 free
    assert kv.allocate(r2, 12) is None
    assert kv.num_free_blocks == 1 and r2.block_ids == [] and kv.num_blocks_of("b") == 0
    assert kv.drain_events()[-1] == BlockStored(
        block_hashes=r1.block_hashes, parent_block_hash=None, token_ids=list(range(8)), block_size=BS
    )


def test_events_carry_each_blocks_tokens_and_parent_links() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = _req("a", list(range(6)), lora_id=3)
    kv.allocate(r, 6)
    r.num_computed_tokens = 6
    kv.cache_full_blocks(r, 6)  # one full block
    for token in (50, 51):  # decode steps: the second block fills up on the second
        r.append_output_token(token)
        kv.allocate(r, 1)
        r.num_computed_tokens += 1
        kv.cache_full_blocks(r, r.num_computed_tokens)
    kv.cache_full_blocks(r, r.num_computed_tokens)  # idempotent
    ev = kv.drain_events()
    assert ev == [
        BlockStored([r.block_hashes[0]], None, [0, 1, 2, 3], BS, lora_id=3),
        BlockStored([r.block_hashes[1]], r.block_hashes[0], [4, 5, 50, 51], BS, lora_id=3),
    ]
    assert r.block_hashes[1] == hash_block_tokens(r.block_hashes[0], [4, 5, 50, 51], 3)
    assert kv.drain_events() == []


def test_lora_ids_keep_caches_apart() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    _prefill(kv, _req("a", tokens, lora_id=1))
    assert kv.get_computed_blocks(_req("b", tokens, lora_id=2))[1] == 0
    assert kv.get_computed_blocks(_req("c", tokens, lora_id=None))[1] == 0
    assert kv.get_computed_blocks(_req("d", tokens, lora_id=1))[1] == 8


def test_forget_lora_drops_only_that_adapters_blocks_and_reuses_them_first() -> None:
    """An adapter's new weights: its cached blocks become unfindable (one BlockRemoved), held
    ones stay with their request, free ones (reused ones too) are taken before any other
    cached block is evicted, and a request holding old-weight blocks never stores more."""
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    tokens = list(range(9))
    a = _req("a", tokens, lora_id=1)
    _prefill(kv, a)
    kv.free(a)
    a2 = _req("a2", tokens, lora_id=1)
    assert _prefill(kv, a2) == 8
    kv.free(a2)  # a's two full blocks: free, in the reused tier
    held = _req("held", [*range(50, 58), 1], lora_id=1)
    _prefill(kv, held)
    for r in (_req("other", tokens, lora_id=2), _req("base", tokens)):
        _prefill(kv, r)
        kv.free(r)
    kv.drain_events()
    assert kv.forget_lora(1, ["held", "a2", "not-there"]) == 4
    (event,) = kv.drain_events()
    assert isinstance(event, BlockRemoved)
    assert sorted(event.block_hashes) == sorted(a.block_hashes + held.block_hashes)
    assert kv.get_computed_blocks(_req("x", tokens, lora_id=1))[1] == 0
    assert kv.get_computed_blocks(_req("y", tokens, lora_id=2))[1] == 8
    assert kv.get_computed_blocks(_req("z", tokens))[1] == 8
    # held goes on and fills its third block: not stored
    for t in (2, 3, 4):
        held.append_output_token(t)
    assert kv.allocate(held, 3) is not None
    held.num_computed_tokens = 12
    kv.cache_full_blocks(held, 12)
    assert kv.drain_events() == []
    # 9 free: a's 2 forgotten blocks and 3 partial tails hold nothing; other's and base's
    # 2 cached blocks each are evicted only after those
    assert kv.allocate(_req("n", list(range(500, 520))), 20) is not None
    assert kv.drain_events() == []
    assert kv.allocate(_req("m", list(range(600, 604))), 4) is not None
    assert [type(e) for e in kv.drain_events()] == [BlockRemoved]
    kv.free(held)  # freed, a request may cache again (its recompute uses the new weights)
    assert "held" not in kv._uncacheable


def test_lru_evicts_least_recently_freed_and_tails_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = _req("a", [*range(8), 900])  # 2 full blocks + 1 partial
    b = _req("b", [*range(100, 108), 901])
    _prefill(kv, a)
    _prefill(kv, b)
    kv.free(a)  # freed first: evicted first
    kv.free(b)
    kv.drain_events()
    # The uncached partial blocks are reused before anything cached is evicted.
    c = _req("c", list(range(200, 208)))
    assert kv.allocate(c, 8) is not None
    assert kv.drain_events() == []
    d = _req("d", list(range(300, 304)))
    assert kv.allocate(d, 4) is not None
    assert kv.drain_events() == [BlockRemoved([a.block_hashes[1]])]  # a's tail goes first
    e = _req("e", list(range(400, 412)))
    assert kv.allocate(e, 12) is not None
    assert kv.drain_events() == [BlockRemoved([a.block_hashes[0], b.block_hashes[1], b.block_hashes[0]])]


def test_a_hit_revives_a_free_cached_block_so_it_is_not_evicted() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = _req("a", [*range(8), 7])
    _prefill(kv, a)
    kv.free(a)
    b = _req("b", [*range(8), 5, 6])
    assert _prefill(kv, b) == 8
    assert kv.num_free_blocks == 0
    # The pool is full of b's blocks; nothing is evictable.
    assert kv.allocate(_req("c", [1, 2]), 2) is None


def test_reset_clears_everything_and_emits_all_blocks_cleared() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))
    _prefill(kv, a)
    kv.drain_events()
    assert kv.reset_prefix_cache()
    assert kv.drain_events() == [AllBlocksCleared()]
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 0
    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 0
    # Evicting blocks whose hash was dropped emits nothing.
    kv.allocate(_req("c", list(range(32))), 32)
    assert kv.drain_events() == []


def test_two_requests_computing_the_same_block_store_it_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))
    b = _req("b", list(range(9)))
    for r in (a, b):  # both allocated without a lookup: both compute the same blocks
        assert kv.allocate(r, 9) is not None
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_full_blocks(r, 9)
    stored = [e for e in kv.drain_events() if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].block_hashes == a.block_hashes[:2]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_pool_refuses_to_take_more_than_free() -> None:
    pool = BlockPool(2, BS)
    with pytest.raises(RuntimeError):
        pool.take(3)
    with pytest.raises(ValueError):
        BlockPool(0, BS)


def test_blocks_being_computed_this_step_are_findable_at_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))
    assert kv.allocate(a, 9) is not None
    kv.cache_full_blocks(a, 9)  # as the scheduler does when it schedules a's prefill
    b = _req("b", [*range(8), 77])
    hits, n, _ = kv.get_computed_blocks(b)  # admitted later in the same step
    assert n == 8 and [h.block_id for h in hits] == a.block_ids[:2]


def test_a_shared_prefix_outlives_newer_one_off_prompts() -> None:
    """Segmented LRU: a prefix two requests used survives a stream of newer prompts nobody
    reused; under plain LRU (before) the older shared prefix was evicted first."""
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    prefix = list(range(100, 108))  # 2 blocks
    first, second = _req("a", [*prefix, 1, 2]), _req("b", [*prefix, 3, 4])
    _prefill(kv, first)
    assert _prefill(kv, second) == 8  # reused: both prefix blocks hit
    kv.free(first)
    kv.free(second)
    for i in range(6):  # one-off prompts, each released after the prefix was
        r = _req(f"x{i}", [200 + 10 * i + j for j in range(9)])  # 2 full blocks + 1 partial
        _prefill(kv, r)
        kv.free(r)
    assert _prefill(kv, _req("c", [*prefix, 5, 6])) == 8  # still cached
    # ... while the oldest one-off prompts were the ones evicted
    assert _prefill(kv, _req("d", [200 + j for j in range(9)])) == 0


def test_reset_prefix_cache_frees_reused_blocks_for_reuse_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    _prefill(kv, a)
    _prefill(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.num_free_blocks == 6
    assert _prefill(kv, _req("c", list(range(9)))) == 0  # nothing findable any more


def test_cached_prefix_tokens_agrees_with_the_schedulers_lookup_without_a_request() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    _prefill(kv, _req("a", list(range(14))))  # 3 full blocks cached
    for prompt in ([*range(14)], [*range(9), 77, 78], [99, *range(13)], [*range(12)], [1]):
        assert kv.cached_prefix_tokens(prompt) == kv.get_computed_blocks(_req("p", prompt))[1], prompt
    assert kv.cached_prefix_tokens(list(range(14)), lora_id=3) == 0  # another adapter's cache

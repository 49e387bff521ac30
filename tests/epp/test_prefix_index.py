"""The precise index under BlockStored / BlockRemoved / AllBlocksCleared, and the approximate LRU."""

from __future__ import annotations

import random

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.epp.prefix_index import (
    ApproximateIndex,
    PreciseIndex,
    RecentPicks,
    block_keys,
    common_prefix_blocks,
)

BS = 4
TOKENS = list(range(100, 116))  # four full blocks


def stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS)


def test_block_keys_chain_and_ignore_partial_block() -> None:
    keys = block_keys([*TOKENS, 1, 2], BS)
    assert len(keys) == 4
    assert block_keys(TOKENS[:8], BS) == keys[:2]  # a prefix has the same leading keys
    other = block_keys([999, *TOKENS[1:]], BS)
    assert all(a != b for a, b in zip(keys, other, strict=True))  # chained: first change ripples


def test_keys_do_not_depend_on_engine_hashes() -> None:
    a, b = PreciseIndex(), PreciseIndex()
    a.apply("e1", [stored([1, 2, 3, 4], None, TOKENS)])
    b.apply("e1", [stored([77, 88], None, TOKENS[:8]), stored([5, 6], 88, TOKENS[8:])])
    keys = block_keys(TOKENS, BS)
    assert a.prefix_blocks(keys, ["e1"]) == b.prefix_blocks(keys, ["e1"]) == {"e1": 4}


def test_longest_consecutive_prefix_per_endpoint() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [stored([1, 2, 3, 4], None, TOKENS)])
    idx.apply("e2", [stored([9], None, TOKENS[:4])])
    keys = block_keys([*TOKENS, 7, 7, 7, 7], BS)
    assert idx.prefix_blocks(keys, ["e1", "e2", "e3"]) == {"e1": 4, "e2": 1, "e3": 0}


def test_block_removed_applies_by_engine_hash() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [stored([1, 2, 3, 4], None, TOKENS)])
    idx.apply("e1", [BlockRemoved([3])])
    keys = block_keys(TOKENS, BS)
    assert idx.prefix_blocks(keys, ["e1"]) == {"e1": 2}  # the hole ends the consecutive run
    idx.apply("e1", [BlockRemoved([12345])])  # unknown hash: ignored
    assert idx.block_count("e1") == 3


def test_all_blocks_cleared_drops_only_that_endpoint() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [stored([1, 2], None, TOKENS[:8])])
    idx.apply("e2", [stored([1, 2], None, TOKENS[:8])])
    idx.apply("e1", [AllBlocksCleared()])
    keys = block_keys(TOKENS[:8], BS)
    assert idx.prefix_blocks(keys, ["e1", "e2"]) == {"e1": 0, "e2": 2}
    assert idx.block_count("e1") == 0


def test_unknown_parent_is_an_orphan_not_a_wrong_entry() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [stored([5, 6], 4242, TOKENS[8:])])  # the parent's BlockStored was lost
    assert idx.block_count("e1") == 0
    assert idx.orphan_blocks == 2


def test_replayed_duplicate_is_counted_once() -> None:
    idx = PreciseIndex()
    ev = stored([1, 2], None, TOKENS[:8])
    idx.apply("e1", [ev, ev])
    idx.apply("e1", [BlockRemoved([1, 2])])
    assert idx.block_count("e1") == 0


def test_same_tokens_under_two_engine_hashes_need_both_removals() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [stored([1], None, TOKENS[:4]), stored([2], None, TOKENS[:4])])
    keys = block_keys(TOKENS[:4], BS)
    idx.apply("e1", [BlockRemoved([1])])
    assert idx.prefix_blocks(keys, ["e1"]) == {"e1": 1}
    idx.apply("e1", [BlockRemoved([2])])
    assert idx.prefix_blocks(keys, ["e1"]) == {"e1": 0}


def test_lora_blocks_do_not_match_base_model() -> None:
    idx = PreciseIndex()
    idx.apply("e1", [BlockStored([1], None, TOKENS[:4], BS, lora_id=3)])
    assert idx.prefix_blocks(block_keys(TOKENS[:4], BS), ["e1"]) == {"e1": 0}
    assert idx.prefix_blocks(block_keys(TOKENS[:4], BS, lora_id=3), ["e1"]) == {"e1": 1}


def test_approximate_index_is_lru_bounded() -> None:
    idx = ApproximateIndex(capacity=3)
    idx.record([1, 2, 3], "a", when=10.0)
    idx.record([4], "b", when=20.0)  # evicts key 1, the least recently used
    assert len(idx) == 3
    assert idx.prefix_blocks([1, 2], ["a"]) == {"a": 0}
    assert idx.prefix_blocks([2, 3], ["a"]) == {"a": 2}
    idx.forget_endpoint("a")
    assert idx.prefix_blocks([2, 3], ["a"]) == {"a": 0}


def test_common_prefix_blocks_agrees_with_a_linear_scan() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shared = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        a = block_keys([*shared, *(rng.randrange(3) for _ in range(rng.randrange(0, 40)))], BS)
        b = block_keys([*shared, *(rng.randrange(3) for _ in range(rng.randrange(0, 40)))], BS)
        linear = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_blocks(a, b) == linear


def test_recent_picks_count_only_the_window() -> None:
    recent = RecentPicks(window_seconds=10.0)
    keys = block_keys(TOKENS, BS)
    recent.record(keys[:2], "c", when=30.0)
    recent.record(keys[:1], "d", when=12.0)
    recent.record(keys, "e", when=24.0)
    other = block_keys([999, *TOKENS[1:]], BS)
    recent.record(other, "f", when=30.0)  # another first block: shares nothing
    assert recent.prefix_blocks(keys, ["c", "d", "e", "f"], now=30.0) == {"c": 2, "d": 0, "e": 4, "f": 0}
    assert recent.prefix_blocks(keys, ["c", "e"], now=35.0) == {"c": 2, "e": 0}
    assert recent.prefix_blocks(keys, ["c"], now=41.0) == {"c": 0}
    assert recent.prefix_blocks(other, ["f"], now=41.0) == {"f": 0}
    assert not recent._groups  # everything expired is dropped, not only skipped


def test_a_recent_pick_counts_until_its_engine_is_expected_to_have_computed_it() -> None:
    recent = RecentPicks(window_seconds=2.0)
    keys = block_keys(TOKENS, BS)
    recent.record(keys, "queued", when=10.0, until=30.0)  # waits ~20 s in a busy engine's queue
    recent.record(keys, "idle", when=10.0, until=10.5)  # an earlier `until` never shortens the window
    assert recent.prefix_blocks(keys, ["queued", "idle"], now=11.9) == {"queued": 4, "idle": 4}
    assert recent.prefix_blocks(keys, ["queued", "idle"], now=25.0) == {"queued": 4, "idle": 0}
    assert recent.prefix_blocks(keys, ["queued"], now=30.5) == {"queued": 0}
    assert not recent._groups


def test_recent_picks_keep_a_bounded_number_per_endpoint() -> None:
    recent = RecentPicks(window_seconds=100.0, per_endpoint=2)
    keys = block_keys(TOKENS, BS)
    recent.record(keys, "a", when=1.0)
    recent.record(keys[:1], "a", when=2.0)
    recent.record(keys[:1], "a", when=3.0)  # pushes out the full-prompt pick
    assert recent.prefix_blocks(keys, ["a"], now=4.0) == {"a": 1}
    recent.forget_endpoint("a")
    assert recent.prefix_blocks(keys, ["a"], now=4.0) == {"a": 0}


def test_block_keys_are_the_same_in_every_process() -> None:
    """EPP replicas (and bench runs) must key a prompt alike: the latency scorer samples blocks
    by key, so keys that differ per process make replicas and reruns disagree."""
    import subprocess
    import sys

    code = "from kvgate.epp.prefix_index import block_keys; print(block_keys(list(range(64)), 16), block_keys(list(range(64)), 16, 7))"
    runs = {
        subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert runs == {f"{block_keys(list(range(64)), 16)} {block_keys(list(range(64)), 16, 7)}\n"}


def test_a_pick_hold_is_bounded_whatever_the_engine_predicts() -> None:
    """An engine reporting a huge pending prefill asks for a pick to count for hours: it counts
    max_hold_seconds at most, then nothing of it is kept."""
    recent = RecentPicks(window_seconds=2.0, max_hold_seconds=30.0)
    keys = [11, 12, 13]
    recent.record(keys, "a:1", when=0.0, until=1e9)
    assert recent.prefix_blocks(keys, ["a:1"], now=29.0) == {"a:1": 3}
    assert recent.prefix_blocks(keys, ["a:1"], now=31.0) == {"a:1": 0}
    assert len(recent) == 0
    # the short window still applies when the engine predicts less
    recent.record(keys, "a:1", when=100.0, until=100.5)
    assert recent.prefix_blocks(keys, ["a:1"], now=101.5) == {"a:1": 3}


def test_memory_stays_bounded_at_any_pick_rate() -> None:
    """100,000 distinct prompts picked within one hold: the picks and the expiry heap stay
    proportional to max_groups, and the most recent prompts are the ones kept."""
    recent = RecentPicks(window_seconds=2.0, max_hold_seconds=60.0, max_groups=1000)
    for i in range(100_000):
        recent.record([i, i + 1], f"e{i % 8}:1", when=i * 1e-4, until=1e9)
    assert len(recent) <= 1000
    assert len(recent._expiry) <= 2 * 1000 + 1024
    assert recent.prefix_blocks([99_999, 100_000], ["e7:1"], now=11.0) == {"e7:1": 2}
    assert recent.prefix_blocks([0, 1], ["e0:1"], now=11.0) == {"e0:1": 0}  # evicted, oldest first

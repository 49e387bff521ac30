"""The pick's fast paths give what the plain computations they replace give.

Each test draws random cases (holes in an engine's cache, ties, expiring picks) and compares
the optimised structure with a straightforward reference written here.
"""

from __future__ import annotations

import random

from kvgate.api.contracts.kv_events import BlockRemoved, BlockStored
from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.prefix_index import PreciseIndex, RecentPicks, block_keys, chain_key, root_key
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.max_score_picker import MaxScorePicker, tie_breaker
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scheduling.plugins.predicted_latency_scorer import WorkingSets

BS = 4


def leading(keys: list[int], held: set[int]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_block_keys_are_chain_key_block_by_block() -> None:
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 60))]
        lora = rng.choice([None, 3])
        parent, expected = root_key(lora), []
        for start in range(0, len(tokens) - len(tokens) % BS, BS):
            parent = chain_key(parent, tokens[start : start + BS])
            expected.append(parent)
        assert block_keys(tokens, BS, lora) == expected


def test_precise_prefix_walk_matches_each_endpoints_own_blocks() -> None:
    rng = random.Random(2)
    for _ in range(100):
        index = PreciseIndex()
        shared = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        prompts = [[*shared, *(rng.randrange(3) for _ in range(rng.randrange(0, 40)))] for _ in range(3)]
        held: dict[str, set[int]] = {}
        next_hash = 1
        for ep in ("a", "b", "c", "d"):
            tokens = rng.choice(prompts)
            n = len(tokens) // BS
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            if n:
                index.apply(ep, [BlockStored(hashes, None, tokens[: n * BS], BS)])
            holes = [h for h in hashes if rng.random() < 0.2]  # evictions anywhere in the chain
            index.apply(ep, [BlockRemoved(holes)])
            keys = block_keys(tokens, BS)
            held[ep] = {k for k, h in zip(keys, hashes, strict=True) if h not in holes}
        query = block_keys(rng.choice(prompts), BS)
        endpoints = rng.sample(sorted(held), rng.randrange(1, 5))
        assert index.prefix_blocks(query, endpoints) == {ep: leading(query, held[ep]) for ep in endpoints}


def test_recent_picks_with_a_floor_are_the_larger_of_both() -> None:
    rng = random.Random(3)
    for _ in range(100):
        recent = RecentPicks(window_seconds=5.0, per_endpoint=100)
        shared = [rng.randrange(3) for _ in range(rng.randrange(4, 40))]

        def prompt() -> list[int]:
            return block_keys([*shared, *(rng.randrange(3) for _ in range(rng.randrange(0, 40)))], BS)  # noqa: B023

        picks = [(prompt(), rng.choice("abc"), rng.uniform(0, 10)) for _ in range(rng.randrange(0, 12))]
        for keys, ep, when in sorted(picks, key=lambda p: p[2]):
            recent.record(keys, ep, when)
        query = prompt()
        floor = {ep: rng.randrange(0, len(query) + 1) for ep in "ab"}
        got = recent.prefix_blocks(query, ["a", "b", "c"], 10.0, floor)
        for ep in "abc":
            best = max([common(query, k) for k, e, w in picks if e == ep and w >= 5.0], default=0)
            assert got[ep] == max(best, floor.get(ep, 0))


def test_working_sets_count_what_a_per_endpoint_set_counts() -> None:
    rng = random.Random(4)
    ws = WorkingSets(window=3.0, sample=1)
    last: dict[str, dict[int, float]] = {}
    now = 0.0
    for _ in range(400):
        now += rng.uniform(0, 0.5)
        ep = rng.choice("abcd")
        keys = frozenset(rng.sample(range(40), rng.randrange(0, 8)))
        if rng.random() < 0.05:
            ws.forget(ep)
            last.pop(ep, None)
            continue
        ws.touch(ep, keys, now)
        last.setdefault(ep, {}).update(dict.fromkeys(keys, now))
        query = frozenset(rng.sample(range(40), 10))
        alive = {e: {k for k, t in seen.items() if t >= now - 3.0} for e, seen in last.items()}
        assert {e: ws.blocks(e, now) for e in "abcd"} == {e: len(alive.get(e, ())) for e in "abcd"}
        counts = ws.holds_all(query)
        assert {e: counts.get(e, 0) for e in "abcd"} == {e: len(query & alive.get(e, set())) for e in "abcd"}
        assert ws.holds_all(query).get(ep, 0) == len(query & alive[ep])


def _ctx(prompt: str) -> SchedulingContext:
    body = {"model": "m", "prompt": prompt}
    request = InferenceRequest("r", "m", "m", body, _token_ids=list(range(40)), _prompt_text=prompt)
    return SchedulingContext(request, Datastore(), now=0.0)


def test_max_score_picker_chooses_as_a_full_ranking_would() -> None:
    rng = random.Random(5)
    store = Datastore()
    store.set_endpoints([Endpoint(f"10.0.0.{i}:8000") for i in range(8)])
    endpoints = store.all()
    picker = MaxScorePicker()
    for n in range(300):
        ctx = _ctx(f"prompt {n}")
        scores = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in endpoints]
        rank = tie_breaker(ctx)
        ranked = sorted(range(len(endpoints)), key=lambda i: (-scores[i], rank(endpoints[i].address)))
        assert picker.pick(ctx, endpoints, scores) == [endpoints[ranked[0]]]


def test_the_fallback_index_records_only_endpoints_without_kv_events() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")])
    live, blind = store.all()
    live.kv_events_live = True
    scorer = PrecisePrefixCacheScorer(block_size=BS)
    ctx = _ctx("p")
    scorer.pre_request(ctx, live)
    scorer.pre_request(ctx, blind)
    keys = block_keys(list(range(40)), BS)
    assert scorer.fallback.prefix_blocks(keys, [live.address, blind.address]) == {
        live.address: 0,
        blind.address: len(keys),
    }


def test_the_picker_still_picks_when_a_score_is_nan() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")])
    endpoints = store.all()
    assert MaxScorePicker().pick(_ctx("p"), endpoints, [float("nan"), 0.5])


def test_block_keys_refuse_a_block_size_that_is_not_positive() -> None:
    import pytest

    with pytest.raises(ValueError, match="block size"):
        block_keys([1, 2, 3], 0)


def test_the_working_set_sample_never_counts_more_blocks_than_there_are() -> None:
    rng = random.Random(6)
    ws = WorkingSets(window=100.0, sample=8)
    distinct: set[int] = set()
    for i in range(200):
        tokens = [rng.randrange(50) for _ in range(rng.randrange(0, 200))]
        keys = block_keys(tokens, BS)
        distinct.update(keys)
        ws.touch("a", ws.sampled(keys), float(i))
        assert ws.blocks("a", float(i)) <= len(distinct)
        assert ws.holds_all(ws.sampled(keys)).get("a", 0) <= len(keys)


def test_pending_prefill_total_is_the_sum_of_the_pending_picks() -> None:
    """The running total every pick reads stays the sum of the picks still counted, through
    picks, corrections, admissions, scrapes and age-outs."""
    rng = random.Random(6)
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1:8000")])
    (state,) = store.all()
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.001, 0.02, 0.5, 3.0])
        op = rng.random()
        if op < 0.5:
            state.note_pick(now, rng.choice([0, 7, 900]))
        elif op < 0.6:
            state.set_last_pick_tokens(rng.randrange(1000))
        elif op < 0.8:
            state.note_own_admission(now)
        else:
            state.confirm_picks(now - rng.uniform(0, 2))
        assert state.pending_prefill_tokens() == sum(state.pending_tokens)
        assert len(state.pending_tokens) == len(state.pending_picks)

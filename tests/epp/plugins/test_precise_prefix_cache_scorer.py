"""precise-prefix-cache-scorer (kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer)."""

from __future__ import annotations

import time

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.epp.datastore import Datastore
from kvgate.epp.prefix_index import block_keys
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.testing.scheduling import CharTokenizer, ctx_for, make_request


def test_precise_prefix_scorer_reads_kv_event_index(store: Datastore) -> None:
    a, b, c = store.all()
    for s in (a, b, c):
        s.kv_events_live = True
    prompt = "x" * 32  # 8 blocks of 4 tokens with the char tokenizer
    tokens = CharTokenizer().encode(prompt)
    store.index.apply(b.address, [BlockStored(list(range(8)), None, tokens, 4)])
    store.index.apply(c.address, [BlockStored([1, 2], None, tokens[:8], 4)])
    scorer = PrecisePrefixCacheScorer(block_size=4, recent_window_seconds=0)
    assert scorer.score(ctx_for(store, make_request(prompt)), store.all()) == [0.0, 1.0, 0.25]


def test_precise_prefix_scorer_falls_back_for_endpoints_without_events(store: Datastore) -> None:
    a, _b, _ = store.all()
    scorer = PrecisePrefixCacheScorer(block_size=4)
    ctx = ctx_for(store, make_request("y" * 16))
    scorer.pre_request(ctx, a)  # nobody publishes events: routing is remembered
    assert scorer.score(ctx_for(store, make_request("y" * 16)), store.all()) == [1.0, 0.0, 0.0]
    # once a publishes events, its recent routing counts only inside the window
    a.kv_events_live = True
    late = SchedulingContext(make_request("y" * 16), store, time.monotonic() + 60)
    assert scorer.score(late, store.all()) == [0.0, 0.0, 0.0]


def test_precise_prefix_chat_uses_template(store: Datastore) -> None:
    a = store.all()[0]
    a.kv_events_live = True
    req = make_request()
    req.body = {"model": "m", "messages": [{"role": "user", "content": "hi there friend"}]}
    tokens = CharTokenizer().encode("<user>hi there friend<assistant>")
    n = len(tokens) // 4
    store.index.apply(a.address, [BlockStored(list(range(n)), None, tokens[: n * 4], 4)])
    s = PrecisePrefixCacheScorer(block_size=4).score(ctx_for(store, req), [a])
    assert s == [1.0]
    assert block_keys(tokens, 4)


def test_precise_prefix_scorer_uses_each_engines_own_block_size(store: Datastore) -> None:
    """Engines started with another --block-size than the scorer's default still score: the size
    comes from their KV events (before, a fixed 16 matched nothing, silently)."""
    a, b, c = store.all()
    for s in (a, b, c):
        s.kv_events_live = True
    prompt = "z" * 64
    tokens = CharTokenizer().encode(prompt)
    store.index.apply(a.address, [BlockStored(list(range(4)), None, tokens, 16)])  # 4 blocks of 16
    store.index.apply(b.address, [BlockStored([7], None, tokens[:32], 32)])  # 1 of 2 blocks of 32
    scorer = PrecisePrefixCacheScorer(block_size=4, recent_window_seconds=0)
    assert store.index.block_size(a.address) == 16 and store.index.block_size(c.address) is None
    assert scorer.score(ctx_for(store, make_request(prompt)), store.all()) == [1.0, 0.5, 0.0]

"""KV-event subscription: sequence gaps, replay, publisher restarts — against the engine's real
publisher over ZMQ, and the gap logic on its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.kv_subscriber import EndpointSubscriber, KVEventSubscribers
from kvgate.epp.prefix_index import block_keys

BS = 4
EP = Endpoint("10.0.0.1:8000")


def batch(*events) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), events=list(events)))


def chain(n_blocks: int) -> list[bytes]:
    """n batches, each storing one block chained on the previous one (engine hashes 1..n)."""
    out = []
    for i in range(n_blocks):
        tokens = list(range(i * BS, (i + 1) * BS))
        out.append(batch(BlockStored([i + 1], i if i else None, tokens, BS)))
    return out


TOKENS = list(range(5 * BS))


def held(ds: Datastore) -> int:
    return ds.index.prefix_blocks(block_keys(TOKENS, BS), [EP.address])[EP.address]


def subscriber(replay=None) -> tuple[Datastore, EndpointSubscriber]:
    ds = Datastore()
    ds.set_endpoints([EP])
    return ds, EndpointSubscriber(ds, EP, replay)


async def test_in_order_messages_build_the_index() -> None:
    ds, sub = subscriber()
    for seq, payload in enumerate(chain(5)):
        await sub.on_message(seq, payload)
    assert held(ds) == 5 and sub.gaps == 0


async def test_gap_is_filled_by_replay() -> None:
    batches = chain(5)
    asked = []

    async def replay(start: int):
        asked.append(start)
        return list(enumerate(batches))[start:]

    ds, sub = subscriber(replay)
    await sub.on_message(0, batches[0])
    await sub.on_message(3, batches[3])  # 1 and 2 were lost
    await sub.on_message(4, batches[4])
    assert asked == [1] and sub.gaps == 1 and sub.replayed == 2
    assert held(ds) == 5


async def test_unfillable_gap_drops_the_endpoint_entries() -> None:
    batches = chain(5)

    async def replay(start: int):
        return [(2, batches[2])]  # the buffer no longer holds seq 1

    ds, sub = subscriber(replay)
    await sub.on_message(0, batches[0])
    assert held(ds) == 1
    await sub.on_message(3, batches[3])
    assert ds.index.block_count(EP.address) == 0  # nothing half-trusted
    assert ds.index.orphan_blocks == 1  # block 4's parent (3) is unknown now


async def test_gap_without_replay_socket_or_failing_replay_drops_entries() -> None:
    batches = chain(3)

    async def broken(start: int):
        raise TimeoutError("no answer")

    for replay in (None, broken):
        ds, sub = subscriber(replay)
        await sub.on_message(0, batches[0])
        await sub.on_message(2, batches[2])
        assert ds.index.block_count(EP.address) == 0


async def test_sequence_reset_means_a_restarted_engine() -> None:
    batches = chain(3)
    ds, sub = subscriber()
    for seq, payload in enumerate(batches):
        await sub.on_message(seq, payload)
    await sub.on_message(0, batch(BlockStored([99], None, [7, 7, 7, 7], BS)))
    assert sub.resets == 1 and held(ds) == 0 and ds.index.block_count(EP.address) == 1


async def test_first_message_after_late_join_replays_history() -> None:
    batches = chain(4)

    async def replay(start: int):
        return list(enumerate(batches))[start:]

    ds, sub = subscriber(replay)
    await sub.on_message(3, batches[3])  # joined late: 0..2 happened before we subscribed
    assert held(ds) == 4 and sub.gaps == 0


async def test_against_the_engine_publisher_over_zmq() -> None:
    pytest.importorskip("kvgate.engine.server.kv_publisher")
    from kvgate.engine.server.kv_publisher import KVEventPublisher

    pub = KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv@10.0.0.1:8000@default", replay_endpoint="tcp://127.0.0.1:*"
    )
    try:
        # published before anyone subscribed: only the replay socket can deliver these
        for i in range(3):
            tokens = list(range(i * BS, (i + 1) * BS))
            pub.publish([BlockStored([i + 1], i if i else None, tokens, BS)])
        ds = Datastore()
        subs = KVEventSubscribers(ds)
        ds.set_endpoints([Endpoint(EP.address, kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)])
        await asyncio.sleep(0.3)  # SUB connects
        assert not ds.get(EP.address).kv_events_live  # nothing received yet: not trusted
        for i in range(3, 5):
            tokens = list(range(i * BS, (i + 1) * BS))
            pub.publish([BlockStored([i + 1], i, tokens, BS)])
        for _ in range(100):
            if held(ds) == 5:
                break
            await asyncio.sleep(0.02)
        assert held(ds) == 5
        assert ds.get(EP.address).kv_events_live
        assert subs.subscribers[EP.address].replayed == 3
        pub.publish([AllBlocksCleared()])
        for _ in range(100):
            if ds.index.block_count(EP.address) == 0:
                break
            await asyncio.sleep(0.02)
        assert ds.index.block_count(EP.address) == 0
        ds.set_endpoints([])  # endpoint gone: its subscriber stops
        await asyncio.sleep(0)
        assert EP.address not in subs.subscribers
        await subs.close()
    finally:
        pub.close()

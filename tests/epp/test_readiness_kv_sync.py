"""EPP readiness waits for each engine's KV-event replay, bounded for engines that never answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.health import EppHealth
from kvgate.epp.kv_subscriber import KVEventSubscribers
from kvgate.testing import eventually_async
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(60)


async def ready_after(health: EppHealth, seconds: float) -> float:
    """Seconds until the EPP's readiness holds."""
    t0 = time.monotonic()

    async def ready() -> bool:
        if not health.ready:
            await health.refresh()
        return health.ready

    await eventually_async(ready, seconds, "EPP readiness", interval=0.01)
    return time.monotonic() - t0


async def test_ready_only_after_the_initial_replay_filled_the_index(tmp_path) -> None:
    eng = harness.start_engine(tmp_path)
    try:
        await asyncio.to_thread(eng.wait_ready)
        # the engine caches a prompt before this EPP starts: only the replay can tell us
        async with httpx.AsyncClient() as c:
            r = await c.post(
                f"http://{eng.address}/v1/completions", json={"prompt": "cached " * 64, "max_tokens": 1}
            )
            assert r.status_code == 200
        ds = Datastore()
        health = EppHealth(ds)
        await health.start()
        assert not health.ready  # no endpoints yet
        subs = KVEventSubscribers(ds)
        try:
            ds.set_endpoints([Endpoint(eng.address, kv_events=eng.kv_events, kv_replay=eng.kv_replay)])
            await ready_after(health, 10)
            assert ds.index.block_count(eng.address) > 0  # the engine's cache is known when ready
        finally:
            await subs.close()
    finally:
        harness.stop_all(eng.proc)


async def test_an_engine_that_never_replays_holds_readiness_only_up_to_the_bound() -> None:
    pub, replay = harness.free_ports(2)  # nothing listens: the replay request is never answered
    ds = Datastore()
    health = EppHealth(ds)
    await health.start()
    subs = KVEventSubscribers(ds, replay_timeout=5.0, sync_timeout=0.5)
    try:
        ds.set_endpoints(
            [
                Endpoint(
                    "127.0.0.1:1", kv_events=f"tcp://127.0.0.1:{pub}", kv_replay=f"tcp://127.0.0.1:{replay}"
                )
            ]
        )
        await health.refresh()
        assert not health.ready
        waited = await ready_after(health, 5)
        assert 0.3 < waited < 3
    finally:
        await subs.close()


async def test_endpoints_without_kv_events_are_ready_at_once() -> None:
    ds = Datastore()
    health = EppHealth(ds)
    await health.start()
    ds.set_endpoints([Endpoint("127.0.0.1:1")])
    await health.refresh()
    assert health.ready

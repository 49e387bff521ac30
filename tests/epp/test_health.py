"""gRPC health on the health port is answered off the EPP's event loop: a loop busy for seconds
still answers at once; a loop that has made no progress for stall_s answers NOT_SERVING."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.health import (
    EXT_PROC,
    GIE_READINESS,
    LIVENESS,
    NOT_SERVING,
    READINESS,
    SERVING,
    EppHealth,
    ThreadedHealthServer,
)
from kvgate.testing.polling import eventually_async


def _check(port: int, service: str, timeout: float = 1.0) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


async def test_a_busy_loop_still_answers_health_and_a_stalled_one_says_not_serving() -> None:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("127.0.0.1:1")])
    health = EppHealth(datastore, stall_s=1.5)
    server = ThreadedHealthServer(health, "127.0.0.1", 0)
    await health.start()
    server.start()
    watch = asyncio.create_task(health.watch())

    async def serving() -> bool:
        return await asyncio.to_thread(_check, server.port, LIVENESS) == SERVING

    try:
        await eventually_async(serving, 10, "liveness SERVING")
        # The loop held for 1.2 s, as a burst of picks on a saturated host holds it: a check
        # with a 1 s deadline (Envoy's) is answered while the loop is still held.
        answers: list[int] = []

        def ask_during_the_hold() -> None:
            time.sleep(0.3)
            answers.append(_check(server.port, LIVENESS, timeout=0.5))

        asker = asyncio.get_running_loop().run_in_executor(None, ask_during_the_hold)
        time.sleep(1.2)  # noqa: ASYNC251 (holding the loop is the point)
        await asker
        assert answers == [SERVING]
        # Held past stall_s: every service reports NOT_SERVING until the loop ticks again.
        time.sleep(1.8)  # noqa: ASYNC251
        assert _check(server.port, LIVENESS) == NOT_SERVING
        await eventually_async(serving, 10, "liveness SERVING once the loop ticks again")
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.to_thread(_check, server.port, "no-such-service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await health.shutdown()
        assert await asyncio.to_thread(_check, server.port, EXT_PROC) == NOT_SERVING
    finally:
        watch.cancel()
        server.stop()


async def test_readiness_is_also_reported_under_gies_service_name() -> None:
    # GIE's chart and llm-d's probe the EPP with service "inference-extension": a Deployment
    # written for their EPP must see kvgate's become ready, not be restarted forever
    datastore = Datastore()
    health = EppHealth(datastore)
    server = ThreadedHealthServer(health, "127.0.0.1", 0)
    await health.start()
    server.start()
    try:
        await health.refresh()
        for service in (READINESS, GIE_READINESS):
            assert await asyncio.to_thread(_check, server.port, service) == NOT_SERVING
        datastore.set_endpoints([Endpoint("127.0.0.1:1")])  # no KV events: nothing to replay
        await health.refresh()
        for service in (READINESS, GIE_READINESS, EXT_PROC):
            assert await asyncio.to_thread(_check, server.port, service) == SERVING
    finally:
        await health.shutdown()
        server.stop()

"""An EPP whose event loop is starved stays slow, never fails: real Envoy in front, a scorer that
blocks the loop for every pick, far more requests at once than it can pick in a second.

Before the fix, the default (grpclib) server lost requests two ways. Its HTTP/2 layer allowed
100 streams per connection and closed the whole connection at the 101st, resetting every stream
on it; and Envoy's health check, asked on the starved loop, timed out twice, so Envoy took the
overloaded EPP for a dead one and answered everything with no_healthy_upstream. grpcio's server
is run on the same load: whatever it serves, the default server must serve too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from kvgate.epp.datastore import Endpoint, EndpointState
from kvgate.epp.http_get import KeepAliveGetter, ScrapeError
from kvgate.epp.scheduling import config as scheduling_config
from kvgate.epp.scheduling import registry
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes
from kvgate.epp.server import EppServer, ServerSettings
from kvgate.testing.processes import Envoy, start_envoy, stop_all
from kvgate.testing.upstream_stub import stub_handler, stub_in_thread, vllm_metrics

BLOCK_S = 0.02  # every pick holds the EPP's event loop this long: 50 picks/s at most
REQUESTS = 250  # at once: 5 s of picks queued, past Envoy's 1 s health-check timeout twice over


@dataclass
class BlockingScorer:
    """A scorer as slow as a heavy one on a saturated host, holding the loop as CPU work does."""

    type_name: ClassVar[str] = "test-blocking-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
    name: str = type_name

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        time.sleep(BLOCK_S)
        return [1.0] * len(endpoints)


@pytest.fixture
def engine() -> Iterator[str]:
    """An engine stub on a loop of its own (the test's loop is the EPP's, and it is starved)."""
    with stub_in_thread(stub_handler(vllm_metrics("m"))) as address:
        yield address


def _burst(port: int, count: int) -> Counter[str]:
    """``count`` requests at once through Envoy, from a thread and loop of their own."""
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def one() -> str:
        conn = KeepAliveGetter("127.0.0.1", port, timeout=60)
        try:
            status, answer = await conn.request(raw)
        except ScrapeError as exc:
            return f"client error {exc}"
        finally:
            conn.close()
        return "200" if status == 200 else f"{status} {answer[:120]!r}"

    async def all_() -> list[str]:
        return await asyncio.gather(*(one() for _ in range(count)))

    return Counter(asyncio.run(all_()))


@pytest.mark.parametrize("grpc_server", ["grpclib", "grpcio"])
async def test_a_starved_epp_serves_every_request_slowly(
    grpc_server: str, engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry.load_plugins()  # then the registry holds every plugin type, and this one for the test
    monkeypatch.setitem(registry._TYPES, BlockingScorer.type_name, BlockingScorer)
    config = scheduling_config.parse_config(
        {
            "plugins": [{"type": BlockingScorer.type_name}, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "slow",
                    "plugins": [{"pluginRef": BlockingScorer.type_name}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )
    epp = EppServer(
        ServerSettings(
            config=config,
            endpoints=[Endpoint(engine)],
            grpc_port=0,
            grpc_health_port=0,
            metrics_port=0,
            secure_serving=False,
            grpc_server=grpc_server,
        )
    )
    await epp.start()
    envoy = start_envoy(tmp_path, epp.grpc_port, epp.health_port)
    try:
        for _ in range(400):  # the engine scraped, Envoy up and its health check passed
            if all(epp.datastore.reachable(s) for s in epp.datastore.all()) and await asyncio.to_thread(
                _envoy_ready, envoy
            ):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the gateway never became ready")
        outcomes = await asyncio.to_thread(_burst, envoy.port, REQUESTS)
        stats = await asyncio.to_thread(envoy.stats)
    finally:
        stop_all(envoy.proc)
        await epp.stop()
    assert outcomes == Counter({"200": REQUESTS}), (outcomes, _epp_cluster_stats(stats))
    # Envoy never took the busy EPP for a dead one
    assert stats.get("cluster.epp.health_check.failure", 0) == 0


def _envoy_ready(envoy: Envoy) -> bool:
    try:
        envoy.wait_ready(timeout=0.5)
        envoy.wait_epp_healthy(timeout=0.5)
    except AssertionError:
        return False
    return True


def _epp_cluster_stats(stats: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in stats.items() if k.startswith(("cluster.epp.", "http.kvgate.ext_proc"))}

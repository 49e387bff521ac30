"""Flow control through real Envoy and a real EPP: a request held in the EPP while the pool has no
room is dispatched when room appears, even after longer than Envoy's per-message timeout; one
held past its TTL gets a 503 with Retry-After in OpenAI's error shape; sheddable work is refused
with a 429 at once while there is no room.

The engine is a stub whose scraped queue the test sets (busy: 50 waiting; idle: none), so what
is tested is what the gateway does with a full pool, not an engine's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvgate.gateway.envoy_config import GatewayLimits
from kvgate.local.stack import kvgate_argv
from kvgate.testing import processes as harness
from kvgate.testing.upstream_stub import stub_handler, stub_in_thread, vllm_metrics

pytestmark = pytest.mark.timeout(120)

MESSAGE_TIMEOUT_S = 2.0  # Envoy's wait for one EPP answer, shortened so a hold outlasts it
TTL_S = 5.0


@dataclass
class Pool:
    url: str
    metrics: list[bytes] = field(default_factory=lambda: [vllm_metrics("default")])

    def busy(self) -> None:
        self.metrics[0] = vllm_metrics("default", waiting=50, running=8)

    def idle(self) -> None:
        self.metrics[0] = vllm_metrics("default")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    log_dir = tmp_path_factory.mktemp("flow")
    state = Pool("")
    with stub_in_thread(stub_handler(lambda: state.metrics[0])) as address:
        grpc, health, metrics = harness.free_ports(3)
        argv = kvgate_argv(
            "epp",
            "serve",
            "--endpoints",
            address,
            "--grpc-port",
            str(grpc),
            "--grpc-health-port",
            str(health),
            "--metrics-port",
            str(metrics),
            "--secure-serving=false",
            "--profile",
            "random",  # no tokenizer to load
            "--objective",
            "batch=-1",
            "--flow-ttl",
            str(TTL_S),
        )
        procs = [harness.Process(f"epp-{grpc}", argv, log_dir / f"epp-{grpc}.log").start()]
        try:
            epp = harness.Epp(procs[0], grpc, health, metrics, secure=False)
            envoy = harness.start_envoy(
                log_dir, grpc, health, limits=GatewayLimits(epp_message_timeout_s=MESSAGE_TIMEOUT_S)
            )
            procs.append(envoy.proc)
            harness.wait_gateway(epp, envoy)
            state.url = envoy.url
            yield state
        finally:
            state.idle()
            harness.stop_all(*procs)


def _post(pool: Pool, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{pool.url}/v1/completions",
        json={"model": "default", "prompt": "held", "max_tokens": 1},
        headers=headers or {},
        timeout=60,
    )


def test_a_held_request_goes_when_room_appears_after_envoys_message_timeout(pool: Pool) -> None:
    pool.busy()
    time.sleep(0.3)  # a scrape sees it
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(_post(pool)))
    started = time.monotonic()
    sender.start()
    time.sleep(MESSAGE_TIMEOUT_S + 1.0)
    assert not answer, "answered while the pool was full"
    pool.idle()
    sender.join(30)
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    assert time.monotonic() - started > MESSAGE_TIMEOUT_S


def test_a_request_held_past_its_ttl_gets_503_with_retry_after(pool: Pool) -> None:
    pool.busy()
    time.sleep(0.3)
    started = time.monotonic()
    resp = _post(pool)
    waited = time.monotonic() - started
    pool.idle()
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"].isdigit()
    error = resp.json()["error"]
    assert error["type"] == "service_unavailable" and "TTL" in error["message"]
    assert waited >= TTL_S - 0.5


def test_sheddable_work_is_refused_at_once_while_there_is_no_room(pool: Pool) -> None:
    pool.busy()
    time.sleep(0.3)
    started = time.monotonic()
    resp = _post(pool, {"x-gateway-inference-objective": "batch"})
    pool.idle()
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["type"] == "rate_limit_exceeded"
    assert time.monotonic() - started < TTL_S

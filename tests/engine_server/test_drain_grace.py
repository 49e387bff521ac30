"""SIGTERM announces draining at once but keeps admitting for the grace period, then refuses."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from kvgate.testing import eventually
from kvgate.testing.engine_server import EngineProcess

DRAINING = "kvgate:draining"


def _complete(eng: EngineProcess) -> httpx.Response:
    return httpx.post(f"{eng.base_url}/v1/completions", json={"prompt": "late", "max_tokens": 4}, timeout=10)


def test_draining_is_announced_at_once_and_requests_still_succeed_in_the_grace_period(
    engine_factory,
) -> None:
    eng: EngineProcess = engine_factory(
        "--simulate", "--sim-itl", "0.01", "--drain-grace-period", "1.5", "--shutdown-timeout", "10"
    )
    assert eng.metrics()[DRAINING] == 0
    assert httpx.get(f"{eng.base_url}/health").status_code == 200
    # a long request keeps the server up past the grace period, so the refusal can be seen
    long: list[httpx.Response] = []
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True}
    worker = threading.Thread(
        target=lambda: long.append(httpx.post(f"{eng.base_url}/v1/completions", json=body, timeout=30))
    )
    worker.start()
    eventually(lambda: eng.metrics()["vllm:num_requests_running"] == 1, 5, "the long request running")
    eng.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    eventually(
        lambda: httpx.get(f"{eng.base_url}/health").status_code == 503, 1, "draining announced", interval=0.01
    )
    assert eng.metrics()[DRAINING] == 1
    health = httpx.get(f"{eng.base_url}/health")
    assert health.json()["error"]["code"] == "draining"
    # a request routed just before the picker noticed: still served
    ok = _complete(eng)
    assert time.monotonic() - signalled < 1.5, "too slow to test inside the grace period"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    # after the grace period: refused with an OpenAI error, then a clean exit
    eventually(lambda: _complete(eng).status_code == 503, 5, "refusing after the grace period", interval=0.01)
    refused = _complete(eng)
    assert refused.json()["error"]["code"] == "draining"
    assert time.monotonic() - signalled >= 1.5
    worker.join(15)
    assert long[0].status_code == 200 and long[0].json()["usage"]["completion_tokens"] == 400
    assert eng.proc.wait(10) == 0

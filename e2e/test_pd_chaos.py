"""Prefill/decode disaggregation under faults, through the gateway: streaming clients send long
prompts while the prefill engine is SIGKILLed, then frozen; every request still completes (the
decode engines prefill locally). A decode engine that dies before pulling leaves no block pinned
on the prefill engine beyond --kv-pin-timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, engine_gauges, start_up, stop_up

pytestmark = pytest.mark.timeout(240)
CLIENTS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(
        tmp_path_factory.mktemp("pd-chaos"),
        "--simulate",
        "--prefill-engines",
        "1",
        "--decode-engines",
        "2",
        "--pd-threshold",
        "64",
        "--epp-replicas",
        "1",
        # a frozen prefill engine costs a request 1.5 s, then it is prefilled where it is
        "--engine-arg=--kv-transfer-timeout=1.5",
        "--engine-arg=--kv-pin-timeout=2",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def _long_prompt(tag: str) -> str:
    return f"[{tag}] " + " ".join(f"w{j}" for j in range(400))


def _load(up: UpProcess, seconds: float, fault: Callable[[], None]) -> list[tuple[int, bool, str]]:
    """CLIENTS streaming clients for `seconds`, `fault()` run once a third of the way in.
    Returns (status, finished with [DONE], tag) per request."""
    url = up.stack["gateway_url"] + "/v1/completions"
    stop = threading.Event()
    results: list[tuple[int, bool, str]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = 0
            while not stop.is_set():
                tag = f"{c}-{i}-{time.monotonic_ns()}"
                body = {
                    "model": up.stack["model"],
                    "prompt": _long_prompt(tag),
                    "max_tokens": 8,
                    "stream": True,
                }
                done = False
                try:
                    with http.stream("POST", url, json=body) as resp:
                        status = resp.status_code
                        for line in resp.iter_lines():
                            done = done or line.strip() == "data: [DONE]"
                except httpx.HTTPError as exc:
                    status = -1
                    tag += f" {type(exc).__name__}"
                with lock:
                    results.append((status, done, tag))
                i += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(seconds / 3)
    fault()
    time.sleep(seconds * 2 / 3)
    stop.set()
    for t in threads:
        t.join(60)
    return results


def _fallbacks(up: UpProcess) -> float:
    return sum(
        engine_gauges(u).get("kvgate:kv_transfer_fallbacks_total", 0) for u in up.stack["decode_engine_urls"]
    )


def test_prefill_engine_killed_then_frozen_loses_nothing(stack: UpProcess) -> None:
    victim = stack.stack["engine_pids"][0]  # the first engine is the prefill engine
    assert stack.stack["prefill_engine_urls"][0] == stack.stack["engine_urls"][0]
    before = _fallbacks(stack)
    results = _load(stack, 6.0, lambda: os.kill(victim, signal.SIGKILL))
    failed = [r for r in results if r[0] != 200 or not r[1]]
    assert results and not failed, failed[:5]
    assert _fallbacks(stack) > before  # some requests did fall back while it was gone

    # restarted by kvgate up's supervisor; freeze it now
    stack.wait_for_line(r"engine-prefill-0 restarted")
    eventually(lambda: stack.stack["engine_pids"][0] != victim, 10, "new prefill pid in stack.json")
    frozen = stack.stack["engine_pids"][0]
    eventually(lambda: engine_gauges(stack.stack["prefill_engine_urls"][0]) is not None, 30, "prefill back")
    before = _fallbacks(stack)
    try:
        results = _load(stack, 6.0, lambda: os.kill(frozen, signal.SIGSTOP))
    finally:
        os.kill(frozen, signal.SIGCONT)
    failed = [r for r in results if r[0] != 200 or not r[1]]
    assert results and not failed, failed[:5]
    assert _fallbacks(stack) > before  # the frozen engine's hand-offs timed out and fell back


def test_a_consumer_that_dies_leaves_no_pinned_blocks(stack: UpProcess) -> None:
    prefill = stack.stack["prefill_engine_urls"][0]
    eventually(lambda: httpx.get(prefill + "/health", timeout=2).status_code == 200, 30, "prefill healthy")
    # what a decode engine does first, then it "dies" before pulling
    body = {
        "model": stack.stack["model"],
        "prompt": _long_prompt("orphan"),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = httpx.post(prefill + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["kv_transfer_params"]["remote_block_ids"]
    assert engine_gauges(prefill)["kvgate:kv_transfer_pinned_blocks"] > 0
    t0 = time.monotonic()
    eventually(lambda: engine_gauges(prefill)["kvgate:kv_transfer_pinned_blocks"] == 0, 10, "pins freed")
    assert time.monotonic() - t0 < 2 + 1.0  # --kv-pin-timeout 2, plus slack

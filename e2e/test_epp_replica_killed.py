"""An EPP replica SIGKILLed while it holds requests' ext_proc streams: through real Envoy with two
real EPP replicas, the requests whose pick it held are picked again by the other replica.

Deterministic: one replica is frozen (SIGSTOP) first, so requests sent then open their ext_proc
streams on it and wait (Envoy already streamed it their headers and body); it is then killed,
which resets those streams before any answer. Envoy retries the stream on the other replica
(grpc_service.retry_policy, the stream's messages buffered for the retry), so none is lost.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)
REQUESTS = 8


def _healthy_epps(envoy: harness.Envoy) -> int:
    text = httpx.get(f"{envoy.admin_url}/clusters", timeout=5).text
    return sum(
        line.startswith("epp::") and line.endswith("::health_flags::healthy") for line in text.splitlines()
    )


def _streams_per_replica(envoy: harness.Envoy) -> dict[int, int]:
    """ext_proc streams Envoy opened per EPP replica port."""
    text = httpx.get(f"{envoy.admin_url}/clusters", timeout=5).text
    out: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("epp::") and "::rq_total::" in line:
            address, _, count = line.removeprefix("epp::").partition("::rq_total::")
            out[int(address.rsplit(":", 1)[1])] = int(count)
    return out


def test_requests_held_by_a_killed_replica_are_picked_by_the_other(tmp_path) -> None:
    """FailClose: a lost stream would be a 503 (FailOpen, checked by hand, lost them too)."""
    engine = harness.start_engine(tmp_path)
    procs = [engine.proc]
    try:
        engine.wait_ready()
        a = harness.start_epp(tmp_path, [engine])
        b = harness.start_epp(tmp_path, [engine])
        procs += [a.proc, b.proc]
        envoy = harness.start_envoy(
            tmp_path,
            a.grpc_port,
            epp_addresses=[f"127.0.0.1:{a.grpc_port}", f"127.0.0.1:{b.grpc_port}"],
            failure_mode="FailClose",
            pool_endpoints=[engine.address],
        )
        procs.append(envoy.proc)
        for p in (engine, a, b, envoy):
            p.wait_ready()
        eventually(lambda: _healthy_epps(envoy) == 2, 15, "Envoy seeing both replicas healthy")
        for i in range(6):  # both replicas in use, as under load (a connection open to each)
            warm = {"model": "default", "prompt": f"warm {i}", "max_tokens": 2}
            resp = httpx.post(f"{envoy.url}/v1/completions", json=warm, timeout=30)
            assert resp.status_code == 200, resp.text
        # the victim: the replica Envoy sends most streams to (right after start-up, Envoy may
        # still send all of them to one replica)
        served = _streams_per_replica(envoy)
        victim = max((a, b), key=lambda e: served.get(e.grpc_port, 0))
        os.kill(victim.proc.popen.pid, signal.SIGSTOP)
        before = envoy.stats().get("http.kvgate.ext_proc.streams_started", 0)
        statuses: list[int] = []

        def send(i: int) -> None:
            body = {"model": "default", "prompt": f"held by a frozen picker {i}", "max_tokens": 2}
            statuses.append(httpx.post(f"{envoy.url}/v1/completions", json=body, timeout=30).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(REQUESTS)]
        for t in threads:
            t.start()
        # every request has opened its stream, some of them on the frozen replica
        eventually(
            lambda: envoy.stats().get("http.kvgate.ext_proc.streams_started", 0) - before >= REQUESTS,
            10,
            "every request's ext_proc stream opened",
        )
        held = REQUESTS - len(statuses)
        assert held > 0, f"no request waited on the frozen replica: {statuses}"
        victim.proc.popen.kill()
        for t in threads:
            t.join(timeout=30)
        stats = {
            k: v for k, v in envoy.stats().items() if v and ("ext_proc" in k or k.startswith("cluster.epp."))
        }
        assert statuses == [200] * REQUESTS, f"{statuses} ({held} were held by the killed replica) {stats}"
    finally:
        harness.stop_all(*procs)


def test_a_request_its_replica_already_answered_survives_the_replicas_death(tmp_path) -> None:
    """The pick is made and the request waits on its (frozen) engine when the only EPP replica is
    SIGKILLed: Envoy is done with the ext_proc stream's request phase, so the request is served
    once the engine thaws, even under FailClose. (The stream still ends when the request does: the
    EPP counts the request in flight until then.)"""
    engine = harness.start_engine(tmp_path)
    procs = [engine.proc]
    try:
        engine.wait_ready()
        epp = harness.start_epp(tmp_path, [engine])
        procs.append(epp.proc)
        envoy = harness.start_envoy(
            tmp_path, epp.grpc_port, failure_mode="FailClose", pool_endpoints=[engine.address]
        )
        procs.append(envoy.proc)
        harness.wait_gateway(epp, envoy)
        warm = {"model": "default", "prompt": "warm", "max_tokens": 2}
        eventually(
            lambda: httpx.post(f"{envoy.url}/v1/completions", json=warm, timeout=30).status_code == 200,
            15,
            "a first request served",
        )
        answered = "http.kvgate.ext_proc.stream_msgs_received"
        before = envoy.stats().get(answered, 0)
        result: dict[str, object] = {}

        def send() -> None:
            body = {"model": "default", "prompt": "picked, then its picker died", "max_tokens": 2}
            resp = httpx.post(f"{envoy.url}/v1/completions", json=body, timeout=60)
            result.update(status=resp.status_code, body=resp.text[:300])

        os.kill(engine.proc.popen.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=send)
            thread.start()
            # both answers (request headers and body) are back: the pick is made
            eventually(lambda: envoy.stats().get(answered, 0) - before >= 2, 15, "the EPP's answer")
            epp.proc.popen.kill()
            epp.proc.popen.wait(timeout=10)
        finally:
            os.kill(engine.proc.popen.pid, signal.SIGCONT)
        thread.join(timeout=30)
        assert result.get("status") == 200, result
    finally:
        harness.stop_all(*procs)

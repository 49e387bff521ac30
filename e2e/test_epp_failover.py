"""Failures through real Envoy: a killed engine leaves rotation; the EPP going down is served
(FailOpen) or fails fast (FailClose)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)
UPSTREAM = "x-kvgate-upstream"
# Envoy's counters of the timeouts a failing EPP call could wait out
WAITS = (
    "http.kvgate.ext_proc.message_timeouts",
    "cluster.epp.upstream_cx_connect_timeout",
    "cluster.epp.upstream_rq_timeout",
    "cluster.epp.upstream_rq_per_try_timeout",
)
FAILED = "http.kvgate.ext_proc.streams_failed"  # the EPP call failed, and FailClose answered


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("epp-failover")
    engines = [harness.start_engine(logs) for _ in range(3)]
    procs = [e.proc for e in engines]
    try:
        for e in engines:
            e.wait_ready()
        # the plain GIE profile: no tokenizer, no KV events (approximate prefix only)
        epp = harness.start_epp(logs, engines, "--profile", "default", kv_events=False)
        procs.append(epp.proc)
        fallback = [e.address for e in engines]
        fail_open = harness.start_envoy(
            logs, epp.grpc_port, failure_mode="FailOpen", fallback_endpoints=fallback
        )
        fail_close = harness.start_envoy(logs, epp.grpc_port, failure_mode="FailClose")
        procs += [fail_open.proc, fail_close.proc]
        epp.wait_ready()
        for envoy in (fail_open, fail_close):
            envoy.wait_ready()
            envoy.wait_epp_healthy()
        yield engines, epp, fail_open, fail_close
    finally:
        harness.stop_all(*procs)


def post(envoy: harness.Envoy, prompt: str) -> httpx.Response:
    return httpx.post(
        f"{envoy.url}/v1/completions",
        json={"model": "default", "prompt": prompt, "max_tokens": 2},
        timeout=10,
    )


def test_killed_engine_leaves_rotation(stack) -> None:
    engines, epp, _, envoy = stack
    victim = engines[0]
    seen = {post(envoy, f"warm {i}").headers[UPSTREAM] for i in range(12)}
    assert victim.address in seen  # it was in rotation
    victim.proc.kill()
    # the EPP's scraper finds it gone: two ready endpoints left
    eventually(
        lambda: harness.metric_sum(epp.metrics_text(), "inference_pool_ready_pods") == 2,
        10,
        "the EPP dropping the killed engine",
    )
    for i in range(30):
        resp = post(envoy, f"after the crash {i}")
        assert resp.status_code == 200, resp.text
        assert resp.headers[UPSTREAM] != victim.address


def test_epp_down_fail_open_serves_fail_close_fails_fast(stack) -> None:
    engines, epp, fail_open, fail_close = stack
    live = {e.address for e in engines if e.proc.alive()}
    for envoy in (fail_open, fail_close):
        assert post(envoy, "epp is up").status_code == 200
    epp.proc.kill()
    for envoy in (fail_open, fail_close):
        envoy.wait_epp_healthy(False)
    for i in range(9):  # round-robin over the static pool; the engine killed earlier is skipped
        resp = post(fail_open, f"fail open {i}")
        assert resp.status_code == 200, resp.text
        assert resp.headers[UPSTREAM] in live
    # A client-set destination header is stripped by Envoy: nobody picks their own engine,
    # not even while the EPP is down and requests bypass it.
    forged = f"127.0.0.1:{harness.free_ports(1)[0]}"
    for i in range(3):
        resp = httpx.post(
            f"{fail_open.url}/v1/completions",
            json={"model": "default", "prompt": f"forged {i}", "max_tokens": 2},
            headers={"x-gateway-destination-endpoint": forged},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers[UPSTREAM] in live
    # FailClose fails fast: the refused connection to the EPP ends the exchange at once, with
    # no timeout (connect or message) waited out.
    before = fail_close.stats()
    t0 = time.monotonic()
    resp = post(fail_close, "fail close")
    elapsed = time.monotonic() - t0
    after = fail_close.stats()
    assert resp.status_code >= 500
    changed = {k: after.get(k, 0) - before.get(k, 0) for k in (*WAITS, FAILED)}
    assert changed == {**dict.fromkeys(WAITS, 0), FAILED: 1}, f"{changed} in {elapsed:.2f} s"

"""A request that fails before its first byte is retried once on another engine, through real
Envoy and the real EPP (the gateway's override-host pool, see gateway/envoy_config.py).

One of the pool's "engines" is a stub that looks perfectly healthy to the EPP (metrics, health)
but refuses every request the way a dying or draining engine does: a 503, or a reset before
any byte. Without the retry about half the requests fail; with it none does.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)

METRICS = (
    b'vllm:num_requests_running{model_name="default"} 0\n'
    b'vllm:num_requests_waiting{model_name="default"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="default"} 0\n'
)


class _Stub(BaseHTTPRequestHandler):
    mode = "503"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = METRICS if self.path == "/metrics" else b"{}"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.mode == "reset":
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            self.connection.close()
            return
        body = b'{"error": {"message": "draining", "type": "service_unavailable", "param": null, "code": "draining"}}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module", params=["503", "reset"])
def stack(request, tmp_path_factory):
    handler = type("Stub", (_Stub,), {"mode": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stub = f"127.0.0.1:{server.server_address[1]}"
    logs = tmp_path_factory.mktemp("retry")
    engine = harness.start_engine(logs)
    procs = [engine.proc]
    try:
        engine.wait_ready()
        # round-robin: half the picks land on the stub, whatever its scores
        argv = [*harness.KVGATE, "epp", "serve", "--endpoints", f"{engine.address},{stub}"]
        grpc_port, health, metrics = harness.free_ports(3)
        argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health)]
        argv += ["--metrics-port", str(metrics), "--secure-serving=false", "--profile", "round-robin"]
        epp = harness.Epp(
            harness.Process("epp", argv, logs / "epp.log").start(), grpc_port, health, metrics, False
        )
        procs.append(epp.proc)
        envoy = harness.start_envoy(logs, grpc_port, pool_endpoints=[engine.address, stub])
        procs.append(envoy.proc)
        harness.wait_gateway(epp, envoy)
        yield engine, stub, envoy
    finally:
        harness.stop_all(*procs)
        server.shutdown()


def test_failed_before_first_byte_is_served_by_another_engine(stack) -> None:
    """20 clients at once, half their picks on the failing stub: every one is retried and served
    by the engine. Envoy's default circuit breaker allows only 3 retries in flight per cluster;
    past those the stub's 503 (or a connect error) came back to the client, which is what the
    all-faults chaos run lost after an engine kill."""
    engine, _stub, envoy = stack
    answers: list[tuple[int, str | None]] = []

    def client(c: int) -> None:
        with httpx.Client(base_url=envoy.url, timeout=30) as http:
            for i in range(5):
                body = {"model": "default", "prompt": f"retry me {c} {i}", "max_tokens": 8}
                resp = http.post("/v1/completions", json=body)
                answers.append((resp.status_code, resp.headers.get("x-kvgate-upstream")))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [(200, engine.address)] * 100, answers
    stats = envoy.stats()
    assert stats["cluster.pool.upstream_rq_retry"] > 0, "the stub was never picked"
    assert stats.get("cluster.pool.upstream_rq_retry_overflow", 0) == 0, stats

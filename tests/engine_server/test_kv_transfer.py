"""Prefill/decode hand-offs between real simulated engines: the pull lands in the consumer's
prefix cache, and every way it can fail (producer dead, frozen, forged, never pulled) still
answers the request, with the producer's blocks freed."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)
PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # ~360 tokens: 22 full blocks
FAST = ("--sim-time-scale", "0.1")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    producer = harness.start_engine(logs, "--kv-role", "producer", "--kv-pin-timeout", "2", *FAST)
    consumer = harness.start_engine(logs, "--kv-role", "consumer", "--kv-transfer-timeout", "3", *FAST)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer
    finally:
        harness.stop_all(producer.proc, consumer.proc)


def _prompt(tag: str) -> str:
    """A prompt no other test shares a block with (the consumer caches what it pulled)."""
    return f"[{tag}] " + PROMPT


def _gauges(engine: harness.Engine) -> dict[str, float]:
    text = httpx.get(f"http://{engine.address}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate:kv_transfer") or line.startswith("vllm:external_prefix_cache_hits_total"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(engine: harness.Engine, name: str, **labels: str) -> float:
    total = 0.0
    for key, value in _gauges(engine).items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def _complete(engine: harness.Engine, prompt: str = PROMPT, headers: dict[str, str] | None = None, **extra):
    body = {"model": "default", "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(f"http://{engine.address}/v1/completions", json=body, headers=headers or {}, timeout=30)


def test_a_hand_off_lands_in_the_consumers_prefix_cache(pair) -> None:
    producer, consumer = pair
    prompt = _prompt("handoff")
    hits0 = _metric(consumer, "vllm:external_prefix_cache_hits_total")
    resp = _complete(consumer, prompt, {"x-prefiller-host-port": producer.address})
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 20  # the prompt's whole blocks came from the producer
    assert _metric(consumer, "vllm:external_prefix_cache_hits_total") - hits0 == cached
    # simulated: the bytes the model stands for (131,072 per token), not the framing
    assert _metric(consumer, "kvgate:kv_transfer_bytes_total", direction="received") >= cached * 131_072
    # pulled once: the producer holds nothing for it any more
    eventually(lambda: _metric(producer, "kvgate:kv_transfer_pinned_blocks") == 0, 5, "producer unpinned")


def test_vllm_proxy_flow_with_kv_transfer_params(pair) -> None:
    producer, consumer = pair
    prompt = _prompt("proxy")
    first = _complete(producer, prompt, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == int(producer.address.rsplit(":", 1)[1])
    assert len(params["remote_block_ids"]) >= 20
    assert _metric(producer, "kvgate:kv_transfer_pinned_blocks") == len(params["remote_block_ids"])
    resp = _complete(consumer, prompt, kv_transfer_params=params)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 320
    # a second pull of the same transfer: gone (404), the consumer computes it itself
    again = _complete(consumer, _prompt("again"), kv_transfer_params=params)
    assert again.status_code == 200
    pull = httpx.get(f"http://{producer.address}/v1/kv_transfer/{params['transfer_id']}", timeout=5)
    assert pull.status_code == 404 and pull.json()["error"]["code"] == "not_found"


def test_a_pin_nobody_pulls_is_freed(pair) -> None:
    producer, _ = pair
    expired0 = _metric(producer, "kvgate:kv_transfer_fallbacks_total", reason="pin_expired")
    resp = _complete(producer, _prompt("orphan"), kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    assert resp.status_code == 200 and _metric(producer, "kvgate:kv_transfer_pinned_blocks") > 0
    # --kv-pin-timeout 2: the consumer that should have pulled died
    eventually(lambda: _metric(producer, "kvgate:kv_transfer_pinned_blocks") == 0, 10, "pin expired")
    assert _metric(producer, "kvgate:kv_transfer_fallbacks_total", reason="pin_expired") == expired0 + 1


def test_producer_stream_and_bad_params_are_400(pair) -> None:
    producer, consumer = pair
    resp = _complete(producer, "x", stream=True, kv_transfer_params={"do_remote_decode": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
    for bad in ({"remote_port": 70000}, {"transfer_id": "../../etc"}, {"remote_host": "a/b"}):
        resp = _complete(consumer, "x", kv_transfer_params={"do_remote_prefill": True, **bad})
        assert resp.status_code == 400, (bad, resp.text)


@pytest.mark.parametrize("peer", ["dead", "not-kvgate", "garbage-header"])
def test_a_failed_hand_off_prefills_locally(pair, peer) -> None:
    _, consumer = pair
    if peer == "dead":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            target = f"127.0.0.1:{s.getsockname()[1]}"
    elif peer == "not-kvgate":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Forger)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        target = f"127.0.0.1:{server.server_address[1]}"
    else:
        target = "http://evil/x?y"  # not host:port: no peer at all
    fallbacks0 = _metric(consumer, "kvgate:kv_transfer_fallbacks_total")
    resp = _complete(consumer, _prompt(peer), {"x-prefiller-host-port": target})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    if peer != "garbage-header":
        assert _metric(consumer, "kvgate:kv_transfer_fallbacks_total") == fallbacks0 + 1


def test_without_a_secret_only_local_producers_are_believed(pair) -> None:
    _, consumer = pair  # no KVGATE_KV_TRANSFER_SECRET, no --api-key
    before = _metric(consumer, "kvgate:kv_transfer_fallbacks_total", reason="untrusted_peer")
    resp = _complete(consumer, _prompt("far"), {"x-prefiller-host-port": "10.255.255.1:9"})
    assert resp.status_code == 200 and resp.elapsed.total_seconds() < 2  # not even asked
    assert _metric(consumer, "kvgate:kv_transfer_fallbacks_total", reason="untrusted_peer") == before + 1


def test_a_frozen_producer_costs_the_timeout_not_the_request(tmp_path) -> None:
    producer = harness.start_engine(tmp_path, "--kv-role", "producer", *FAST)
    consumer = harness.start_engine(tmp_path, "--kv-role", "consumer", "--kv-transfer-timeout", "1.5", *FAST)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        os.kill(producer.proc.pid, signal.SIGSTOP)
        try:
            results = []

            def one(i: int) -> None:
                results.append(
                    _complete(consumer, _prompt(f"frozen {i}"), {"x-prefiller-host-port": producer.address})
                )

            threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        finally:
            os.kill(producer.proc.pid, signal.SIGCONT)
        assert [r.status_code for r in results] == [200] * 4
        assert _metric(consumer, "kvgate:kv_transfer_fallbacks_total", reason="timeout") == 4
        # SIGKILL mid-run: the next hand-offs fall back too, nothing fails
        producer.proc.popen.kill()
        for i in range(3):
            assert (
                _complete(
                    consumer, _prompt(f"killed {i}"), {"x-prefiller-host-port": producer.address}
                ).status_code
                == 200
            )
    finally:
        harness.stop_all(producer.proc, consumer.proc)


def test_forged_blocks_never_reach_the_cache(tmp_path) -> None:
    """Cache poisoning: a peer that knows the hash scheme serves the prompt's true block hashes
    with made-up KV and intact digests. Without the pool's secret its tag cannot check out, so
    nothing it sent becomes findable; the request is computed here and answers normally."""
    from kvgate.api.tokenizer import load_tokenizer
    from kvgate.engine.kv_transfer_blocks import prompt_block_hashes

    prompt = _prompt("poison")
    ids = load_tokenizer("default").encode(prompt)
    _Poisoner.hashes = prompt_block_hashes(ids, 16, None)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Poisoner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["KVGATE_KV_TRANSFER_SECRET"] = "pool-secret"
    try:
        consumer = harness.start_engine(tmp_path, "--kv-role", "consumer", *FAST)
    finally:
        del os.environ["KVGATE_KV_TRANSFER_SECRET"]
    try:
        consumer.wait_ready()
        peer = f"127.0.0.1:{server.server_address[1]}"
        resp = _complete(consumer, prompt, {"x-prefiller-host-port": peer}, max_tokens=1)
        assert resp.status_code == 200
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _metric(consumer, "vllm:external_prefix_cache_hits_total") == 0
        assert _metric(consumer, "kvgate:kv_transfer_fallbacks_total", reason="unauthenticated") == 1
    finally:
        harness.stop_all(consumer.proc)
        server.shutdown()


class _Poisoner(BaseHTTPRequestHandler):
    hashes: ClassVar[list[int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        port = self.server.server_address[1]
        params = {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "transfer_id": "poisoned0001",
        }
        _send(self, json.dumps({"kv_transfer_params": params}).encode(), "application/json")

    def do_GET(self) -> None:
        import hashlib

        layout = {"simulated": True, "block_size": 16, "bytes_per_block": 2097152}
        head = json.dumps({"layout": layout, "block_hashes": self.hashes, "block_bytes": 0}).encode()
        digest = hashlib.blake2b(b"", digest_size=8).digest()
        _send(self, head + b"\n" + digest * len(self.hashes) + b"\x00" * 32, "application/octet-stream")


def _send(handler: BaseHTTPRequestHandler, body: bytes, kind: str) -> None:
    handler.send_response(200)
    handler.send_header("content-type", kind)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _Forger(BaseHTTPRequestHandler):
    """Answers like a producer, then serves a transfer whose blocks fail their checksums."""

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        port = self.server.server_address[1]
        body = (
            '{"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.1", '
            f'"remote_port": {port}, "transfer_id": "forgedtransfer01"}}}}'
        ).encode()
        self._send(body, "application/json")

    def do_GET(self) -> None:
        head = b'{"layout": {"simulated": true, "block_size": 16, "bytes_per_block": 2097152}, "block_hashes": [1, 2], "block_bytes": 0}\n'
        self._send(head + b"\x00" * 16, "application/octet-stream")

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

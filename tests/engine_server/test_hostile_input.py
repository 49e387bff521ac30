"""What a client sends cannot hurt the engine: request templates, sizes, slow clients, echoes."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing.engine_server import EngineProcess, launch
from kvgate.testing.processes import children_of

from .conftest import API_KEY, SIM_ARGS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG_STRING = "{% set s = 'x' * 1000000000 %}{{ s|length }}"
NESTED_LOOPS = (
    "{% for a in range(550) %}{% for b in range(550) %}{% for c in range(550) %}"
    "{% endfor %}{% endfor %}{% endfor %}x"
)
HUGE_RANGE = "{% for i in range(10**9) %}{{ i }}{% endfor %}"
DOUBLING = (
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s|length }}"
)
MiB = 1024 * 1024


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def chat(eng: EngineProcess, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{eng.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=timeout)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


def body_with(template: str | None = None, kwargs_template: str | None = None) -> dict:
    body: dict = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if template is not None:
        body["chat_template"] = template
    if kwargs_template is not None:
        body["chat_template_kwargs"] = {"chat_template": kwargs_template}
    return body


@pytest.mark.parametrize("where", ["top-level", "kwargs"])
def test_request_template_refused_without_the_flag(sim_engine: EngineProcess, where: str) -> None:
    body = body_with(BIG_STRING) if where == "top-level" else body_with(kwargs_template=BIG_STRING)
    rss0 = rss_kib(sim_engine.proc.pid)
    t0 = time.monotonic()
    err = error_of(chat(sim_engine, body), 400)
    assert "--trust-request-chat-template" in err["message"]
    assert err["code"] == "chat_template_not_allowed"
    assert time.monotonic() - t0 < 5
    assert rss_kib(sim_engine.proc.pid) < rss0 + 32 * 1024


@pytest.fixture(scope="module")
def trusting_engine(tmp_path_factory: pytest.TempPathFactory) -> EngineProcess:
    eng = launch(tmp_path_factory.mktemp("trusting-engine"), *SIM_ARGS, "--trust-request-chat-template")
    yield eng
    eng.stop()


def test_trusted_request_template_renders(trusting_engine: EngineProcess) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    resp = chat(trusting_engine, body_with(template))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "template", [BIG_STRING, NESTED_LOOPS, HUGE_RANGE, DOUBLING], ids=["1GB", "loops", "range", "doubling"]
)
def test_trusted_request_template_is_bounded(trusting_engine: EngineProcess, template: str) -> None:
    """Even when allowed, an abusive template costs a bounded time and no server memory, and
    the server keeps serving others meanwhile."""
    pid = trusting_engine.proc.pid
    rss0 = rss_kib(pid)
    t0 = time.monotonic()
    err = error_of(chat(trusting_engine, body_with(template)), 400)
    elapsed = time.monotonic() - t0
    assert "chat template" in err["message"]
    assert elapsed < 15, elapsed  # 2 s render limit + a child interpreter's start on a loaded box
    assert rss_kib(pid) < rss0 + 32 * 1024
    assert chat(trusting_engine, body_with()).status_code == 200


def test_bystanders_served_while_a_template_renders(trusting_engine: EngineProcess) -> None:
    import threading

    result: list[httpx.Response] = []
    pid = trusting_engine.proc.pid
    before = children_of(pid)
    attack = threading.Thread(target=lambda: result.append(chat(trusting_engine, body_with(NESTED_LOOPS))))
    attack.start()
    try:
        # the template renders in a child interpreter of the engine
        eventually(lambda: children_of(pid) - before, 10, "the template rendering", interval=0.01)
        for _ in range(5):
            t0 = time.monotonic()
            assert chat(trusting_engine, body_with()).status_code == 200
            assert time.monotonic() - t0 < 1.0  # not queued behind the render
    finally:
        attack.join(30)
    assert result and result[0].status_code == 400


def test_prompt_over_the_context_refused_before_tokenizing(sim_engine: EngineProcess) -> None:
    rss0 = rss_kib(sim_engine.proc.pid)
    text = "lorem ipsum dolor sit amet " * (10 * MiB // 27)
    t0 = time.monotonic()
    for url, body in (
        ("/v1/completions", {"model": "sim-model", "prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "sim-model", "messages": [{"role": "user", "content": text}]}),
    ):
        resp = httpx.post(f"{sim_engine.base_url}{url}", json=body, headers=AUTH, timeout=60)
        assert error_of(resp, 400)["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 10
    assert rss_kib(sim_engine.proc.pid) < rss0 + 128 * 1024


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_chunked_body_is_counted(sim_engine: EngineProcess) -> None:
    """No Content-Length: the limit is enforced on the bytes that arrive, reading stops, and the
    client is told 413 (on a raw socket that reads while it sends: an HTTP client that only reads
    after sending loses the answer to the reset, and a test that forgave that could not fail)."""
    import select
    from urllib.parse import urlsplit

    rss0 = rss_kib(sim_engine.proc.pid)
    url = urlsplit(sim_engine.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    try:
        sock.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            ).encode()
            + _chunk(b'{"model": "sim-model", "prompt": "')
        )
        block = _chunk(b" " * (64 * 1024))
        reply, sent = b"", 0
        while sent < 100 * MiB and b"\r\n\r\n" not in reply:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
            elif writable:
                try:
                    sent += sock.send(block)
                except (BrokenPipeError, ConnectionResetError):
                    break
            else:
                pytest.fail("the engine neither read the body nor answered for 30 s")
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            while b"body_too_large" not in reply and (data := sock.recv(65536)):
                reply += data
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"code":"body_too_large"' in reply.replace(b" ", b""), reply[:500]
    assert sent < 100 * MiB  # it stopped reading long before the whole body
    assert rss_kib(sim_engine.proc.pid) < rss0 + 64 * 1024
    assert chat(sim_engine, body_with()).status_code == 200


def test_lone_surrogate_and_deep_nesting_are_400(sim_engine: EngineProcess) -> None:
    raw = b'{"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    for url, content in (
        ("/v1/chat/completions", raw),
        (
            "/v1/completions",
            b'{"model": "sim-model", "prompt": "x", "e": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ),
    ):
        resp = httpx.post(
            f"{sim_engine.base_url}{url}",
            content=content,
            headers={**AUTH, "content-type": "application/json"},
            timeout=10,
        )
        error_of(resp, 400)


def test_request_id_echo_is_bounded(sim_engine: EngineProcess) -> None:
    for rid, echoed in (("abc-123.x:y_z", True), ("r" * 8000, False), ("a b<script>", False)):
        resp = httpx.post(
            f"{sim_engine.base_url}/v1/chat/completions",
            json=body_with(),
            headers={**AUTH, "x-request-id": rid},
            timeout=10,
        )
        assert resp.status_code == 200
        assert (resp.headers.get("x-request-id") == rid) is echoed


def test_metrics_can_require_the_api_key(engine_factory) -> None:
    eng = engine_factory("--simulate", "--api-key", API_KEY, "--metrics-require-api-key")
    assert error_of(httpx.get(f"{eng.base_url}/metrics", timeout=10), 401)["code"] == "invalid_api_key"
    ok = httpx.get(f"{eng.base_url}/metrics", headers=AUTH, timeout=10)
    assert ok.status_code == 200 and "vllm:num_requests_running" in ok.text
    assert httpx.get(f"{eng.base_url}/health", timeout=10).status_code == 200  # probes stay open


def _close_time(port: int, first: bytes, drip: bytes, budget: float) -> float:
    """Seconds until the server closes a connection that sends `first`, then `drip` every 0.5 s."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=budget)
    sock.sendall(first)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < budget:
            sock.settimeout(0.5)
            try:
                data = sock.recv(4096)
                if data == b"" or data.startswith(b"HTTP/1.1 408"):
                    return time.monotonic() - t0
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0
            try:
                sock.sendall(drip)
            except OSError:
                return time.monotonic() - t0
        return float("inf")
    finally:
        sock.close()


def test_slowloris_headers_and_body_are_cut(engine_factory) -> None:
    eng = engine_factory("--simulate", "--header-read-timeout", "2", "--body-read-timeout", "2")
    port = int(eng.base_url.rsplit(":", 1)[1])
    head = _close_time(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X", budget=20)
    assert head < 6, head
    # a body announced at 1 MB, trickled a byte at a time: answered 408 (or closed) in bound
    body = _close_time(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{",
        b"",
        budget=20,
    )
    assert body < 6, body
    # a healthy kept-alive connection is not cut by the header deadline between requests
    with httpx.Client(base_url=eng.base_url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        time.sleep(2.5)
        assert client.get("/health").status_code == 200


def test_tokenize_follows_the_request_template_rule(
    sim_engine: EngineProcess, trusting_engine: EngineProcess
) -> None:
    """/tokenize with messages renders what chat completions would, so the same rule applies."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    url = "/tokenize"
    err = error_of(
        httpx.post(f"{sim_engine.base_url}{url}", json={**body, "chat_template": BIG_STRING}, headers=AUTH),
        400,
    )
    assert err["code"] == "chat_template_not_allowed"
    resp = httpx.post(
        f"{trusting_engine.base_url}{url}",
        json={**body, "chat_template": "<<{{ messages[0].content }}>>"},
        headers=AUTH,
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert "".join(resp.json()["token_strs"]) == "<<hi>>"
    resp = httpx.post(
        f"{trusting_engine.base_url}{url}",
        json={**body, "chat_template": NESTED_LOOPS},
        headers=AUTH,
        timeout=30,
    )
    assert error_of(resp, 400)["param"] == "messages"


def test_trickled_body_has_a_total_deadline(engine_factory) -> None:
    """A byte every 0.5 s never trips the between-chunks limit; the whole-body one cuts it."""
    eng = engine_factory("--simulate", "--body-read-timeout", "2", "--body-total-timeout", "3")
    port = int(eng.base_url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
    elapsed = _close_time(port, head, b" ", budget=20)
    assert elapsed < 8, elapsed

"""Disconnects free blocks, SIGTERM drains, a full queue answers 429, failure injection works."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from kvgate.testing import eventually
from kvgate.testing.engine_server import EngineProcess
from kvgate.testing.processes import run_kvgate

from .conftest import API_KEY

AUTH = {"authorization": f"Bearer {API_KEY}"}


def _idle(eng: EngineProcess) -> bool:
    m = eng.metrics()
    return (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["vllm:kv_cache_usage_perc"] == 0
    )


def _busy(eng: EngineProcess) -> bool:
    m = eng.metrics()
    return m["vllm:num_requests_running"] >= 1 and m["vllm:kv_cache_usage_perc"] > 0


ABORTED = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-model"}'


def test_disconnect_mid_stream_frees_blocks(sim_engine: EngineProcess) -> None:
    eventually(lambda: _idle(sim_engine), 5, "an idle engine")
    aborted = sim_engine.metrics()[ABORTED]
    body = {"prompt": "tell me a long story " * 10, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{sim_engine.base_url}/v1/completions", json=body, headers=AUTH) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert _busy(sim_engine)
        tokens_before = sim_engine.metrics()["vllm:generation_tokens_total"]
    # 900 tokens at 2 ms each would take ~2 s; the abort must free everything well before that.
    eventually(lambda: _idle(sim_engine), 1.0, "the aborted request's blocks freed", interval=0.02)

    def abort_counted() -> dict[str, float] | None:
        m = sim_engine.metrics()
        return m if m[ABORTED] > aborted else None

    after = eventually(abort_counted, 5, "the abort counted")
    assert after["vllm:generation_tokens_total"] - tokens_before < 300
    assert after[ABORTED] == aborted + 1


def test_disconnect_non_streaming_frees_blocks(sim_engine: EngineProcess) -> None:
    eventually(lambda: _idle(sim_engine), 5, "an idle engine")
    body = {"prompt": "a long answer please " * 10, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim_engine.base_url}/v1/completions", json=body, headers=AUTH, timeout=0.4)
    eventually(lambda: _idle(sim_engine), 1.0, "the timed-out request's blocks freed", interval=0.02)


def _stream_in_thread(base: str, max_tokens: int, results: list, **extra) -> threading.Thread:
    def go() -> None:
        body = {"prompt": "drain test", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **extra}
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
                results.append((r.status_code, [line for line in r.iter_lines() if line]))
        except httpx.HTTPError as exc:
            results.append((0, [repr(exc)]))

    t = threading.Thread(target=go)
    t.start()
    return t


def test_sigterm_drains_in_flight_and_refuses_new(engine_factory) -> None:
    eng = engine_factory(
        "--simulate", "--sim-itl", "0.01", "--shutdown-timeout", "20", "--drain-grace-period", "0"
    )
    results: list = []
    threads = [_stream_in_thread(eng.base_url, 150, results) for _ in range(4)]
    plain: list = []

    def non_streaming() -> None:
        body = {"prompt": "drain test", "max_tokens": 150, "ignore_eos": True}
        r = httpx.post(f"{eng.base_url}/v1/completions", json=body, timeout=30)
        plain.append((r.status_code, r.json()))

    threads += [threading.Thread(target=non_streaming) for _ in range(2)]
    for t in threads[4:]:
        t.start()
    eventually(lambda: eng.metrics()["vllm:num_requests_running"] == 6, 5, "6 requests running")
    eng.proc.send_signal(signal.SIGTERM)
    eventually(lambda: httpx.get(f"{eng.base_url}/health").status_code == 503, 2, "draining", interval=0.02)
    refused = httpx.post(f"{eng.base_url}/v1/completions", json={"prompt": "late"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    for t in threads:
        t.join(10)
    assert eng.proc.wait(10) == 0
    assert [(status, body["usage"]["completion_tokens"]) for status, body in plain] == [(200, 150)] * 2
    assert len(results) == 4
    for status, lines in results:
        assert status == 200
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert sum(len(json.loads(x[6:])["choices"][0]["text"]) > 0 for x in lines[:-1]) >= 140


def test_sigterm_timeout_ends_stragglers_and_exits_zero(engine_factory) -> None:
    eng = engine_factory(
        "--simulate", "--sim-itl", "0.01", "--shutdown-timeout", "0.5", "--drain-grace-period", "0"
    )
    results: list = []
    t = _stream_in_thread(eng.base_url, 5000, results)
    eventually(lambda: eng.metrics()["vllm:num_requests_running"] == 1, 5, "the straggler running")
    started = time.monotonic()
    eng.proc.send_signal(signal.SIGTERM)
    assert eng.proc.wait(10) == 0
    assert time.monotonic() - started < 5
    t.join(5)
    status, lines = results[0]
    assert status == 200
    assert any('"error"' in line and "shut down" in line for line in lines)


def test_max_queued_requests_flag_bounds_the_queue(engine_factory) -> None:
    """The flag reaches the engine: n=2 never fits a queue of 1, whatever else is running (the
    queue filling up is tested in-process, with the engine held still: test_inprocess.py)."""
    eng = engine_factory("--simulate", "--max-queued-requests", "1")
    r = httpx.post(f"{eng.base_url}/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    client = OpenAI(base_url=f"{eng.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="default", prompt="x", max_tokens=1, n=2)
    assert (
        httpx.post(f"{eng.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    )


@pytest.mark.parametrize(("value", "status"), [("500", 500), ("503", 503), ("429", 429)])
def test_failure_injection_status(sim_engine: EngineProcess, value: str, status: int) -> None:
    r = httpx.post(
        f"{sim_engine.base_url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={**AUTH, "x-kvgate-inject-failure": value},
    )
    assert r.status_code == status and r.json()["error"]["code"] == "injected"


def test_failure_injection_delay_and_disconnect(sim_engine: EngineProcess) -> None:
    started = time.monotonic()
    r = httpx.post(
        f"{sim_engine.base_url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={**AUTH, "x-kvgate-inject-failure": "delay=0.3"},
    )
    assert r.status_code == 200 and time.monotonic() - started >= 0.3
    # The connection drops mid-body: a short read (FIN) or a reset, depending on timing.
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.post(
            f"{sim_engine.base_url}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={**AUTH, "x-kvgate-inject-failure": "disconnect"},
        )
    bad = httpx.post(
        f"{sim_engine.base_url}/v1/completions",
        json={"prompt": "x"},
        headers={**AUTH, "x-kvgate-inject-failure": "explode"},
    )
    assert bad.status_code == 400


def test_cli_errors_are_one_line(engine_factory) -> None:
    out = run_kvgate("engine", "serve", "--model", "/nonexistent/model.gguf")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "nonexistent" in out.stderr
    out = run_kvgate("engine", "serve", "--port", "99999")
    assert out.returncode == 2 and "port must be in 0..65535" in out.stderr

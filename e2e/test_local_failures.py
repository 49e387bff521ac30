"""`kvgate up --simulate` under failure: an engine killed mid-run (restarted, rejoins), then Ctrl-C leaving nothing behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.local.ports import port_is_free
from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, engine_gauges, start_up, stop_up
from kvgate.testing.processes import pid_alive


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    # max-num-seqs 2: requests beyond two per engine wait in its queue, so when an engine dies
    # some of its requests are mid-stream and others have not started.
    up = start_up(
        tmp_path_factory.mktemp("fail"),
        "--simulate",
        "--engines",
        "3",
        "--max-num-seqs",
        "2",
        "--expose-upstream-header",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


@dataclass
class Outcome:
    started: bool = False  # got a 200 and a stream object back
    tokens: int = 0
    completed: bool = False
    error: str | None = None
    error_after_s: float | None = None


def test_killed_engine_loses_no_request_that_had_not_started_streaming(stack: UpProcess) -> None:
    info = stack.stack
    # The openai client's own retries (on 5xx and connection errors) plus the EPP dropping the
    # dead engine are what reroute requests that never reached a live engine.
    client = openai.OpenAI(base_url=info["gateway_url"] + "/v1", api_key="unused", max_retries=4, timeout=60)
    outcomes = [Outcome() for _ in range(18)]

    def run(i: int) -> None:
        o = outcomes[i]
        t0 = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model=info["model"],
                # Distinct prompts, so the precise-prefix picker spreads them over all engines.
                messages=[{"role": "user", "content": f"request {i} " + "word " * (i * 7 % 50)}],
                max_tokens=120,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            o.started = True
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    o.tokens += 1
            o.completed = True
        except Exception as exc:  # what a client sees is the point here
            o.error = f"{type(exc).__name__}: {exc}"
            o.error_after_s = time.monotonic() - t0

    admitted_before = _admitted(info)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(outcomes))]
    for t in threads:
        t.start()
    # everything admitted: some streaming, some queued behind max-num-seqs
    eventually(
        lambda: _admitted(info) - admitted_before >= len(outcomes),
        30,
        f"{len(outcomes)} requests at the engines",
    )
    victim = info["engine_pids"][0]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hung after the engine died"

    never_started = [o for o in outcomes if not o.started]
    assert never_started == [], f"requests lost before streaming began: {never_started}"
    broken = [o for o in outcomes if not o.completed]
    for o in broken:  # mid-stream casualties fail cleanly and promptly, never hang
        assert o.error is not None and o.error_after_s is not None and o.error_after_s < 30
    assert any(o.completed for o in outcomes)
    stack.wait_for_line(r"engine-0 exited with signal SIGKILL; restarting it in", timeout=10)
    stack.wait_for_line(r"engine-0 restarted \(pid \d+\)", timeout=30)
    assert stack.stack["engine_pids"][0] != victim  # stack.json follows the restart
    assert pid_alive(stack.stack["engine_pids"][0])

    # Every request is served meanwhile, and the restarted engine, back on its port, rejoins
    # the pool (the EPP's scraper re-adds it once its /metrics answer again).
    dead = info["engine_urls"][0].removeprefix("http://")
    upstreams: list[str] = []
    failed: list[str] = []
    with httpx.Client(timeout=30) as c:

        def served_by_the_restarted_engine() -> bool:
            i = len(upstreams) + len(failed)
            r = c.post(
                info["gateway_url"] + "/v1/chat/completions",
                json={
                    "model": info["model"],
                    "messages": [{"role": "user", "content": f"after {i} " + "word " * (i % 30)}],
                    "max_tokens": 4,
                },
            )
            if r.status_code != 200:
                failed.append(f"{r.status_code}: {r.text}")
                return True  # stop: asserted below
            upstreams.append(r.headers["x-kvgate-upstream"])
            return upstreams[-1] == dead

        eventually(
            served_by_the_restarted_engine, 30, f"the restarted engine {dead} serving again", interval=0
        )
    assert not failed, failed


def _admitted(info: dict) -> float:
    """Requests the engines ever took in: finished, running or waiting."""
    total = 0.0
    for url in info["engine_urls"]:
        g = engine_gauges(url)
        total += (
            g["vllm:request_success_total"] + g["vllm:num_requests_running"] + g["vllm:num_requests_waiting"]
        )
    return total


def test_ctrl_c_stops_everything_and_frees_every_port(stack: UpProcess) -> None:
    info = stack.stack
    pids = [*info["engine_pids"], *info["epp_pids"], info["envoy_pid"]]
    ports = [
        int(u.rsplit(":", 1)[1]) for u in (info["gateway_url"], *info["engine_urls"], info["envoy_admin_url"])
    ]
    ports.append(int(info["epp_metrics_url"].split(":")[2].split("/")[0]))
    t0 = time.monotonic()
    rc = stack.interrupt(timeout=40)
    assert rc == 0, "\n".join(stack.lines[-20:])
    assert time.monotonic() - t0 < 40
    assert "stopped; all ports freed" in stack.lines[-1]
    for pid in pids:
        assert not pid_alive(pid), f"orphan process {pid}"
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # nothing left in its process group either
    for port in ports:
        assert port_is_free(port), f"port {port} still bound"
    # The component logs survive the stack, for post-mortems.
    assert (Path(info["log_dir"]) / "engine-0.log").stat().st_size > 0

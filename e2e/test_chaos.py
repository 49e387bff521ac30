"""Chaos: `kvgate up --simulate` (3 engines, 2 EPP replicas) under 20 streaming clients while an
EPP replica is SIGKILLed or frozen and an engine is drained or SIGKILLed — each alone, then all.

Done means: no request fails or is cut short unless the SIGKILLed engine was serving it when it
died; those end with an error, never hang; requests picked during a drain all succeed. The
supervisor restarts every victim, and the next test starts from a whole stack again.
Windows are shorter than bench/chaos.py's 30 s to keep CI time sane (~12 s each).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.testing.local_up import UpProcess, start_up, stop_up


def _bench_script(name: str):
    """bench/<name>.py (a script, not a package) loaded as a module."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


chaos = _bench_script("chaos")

ENGINES = 3
CLIENTS = 20
WINDOW_S = 12.0
FROZEN_S = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(
        tmp_path_factory.mktemp("chaos"),
        "--simulate",
        "--engines",
        str(ENGINES),
        "--epp-replicas",
        "2",
        "--expose-upstream-header",
        "--quiet",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def _run(stack: UpProcess, fault: str) -> chaos.Run:
    stack_json = stack.log_dir / "stack.json"
    chaos.wait_recovered(stack_json, ENGINES)
    run = chaos.load(
        stack_json, WINDOW_S, CLIENTS, chaos.fault_for(fault, stack_json, WINDOW_S, FROZEN_S), fault
    )
    print(run.figures())
    return run


def _envoy_retry_stats(stack: UpProcess) -> str:
    """Envoy's retry and overflow counters, to tell a lost request's cause in a failure."""
    try:
        admin = json.loads((stack.log_dir / "stack.json").read_text())["envoy_admin_url"]
        stats = httpx.get(
            admin + "/stats", params={"filter": "retry|overflow|ejections_enforced_total|ext_proc"}, timeout=5
        )
        return "\n".join(line for line in stats.text.splitlines() if not line.endswith(": 0"))
    except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        return f"(no Envoy stats: {exc})"


def _assert_done(run: chaos.Run, stack: UpProcess) -> None:
    figures = run.figures()
    assert figures["requests"] > CLIENTS, figures
    bad = run.unexcused()
    detail = "\n".join(
        f"{o.status} upstream={o.upstream} done={o.done} finish={o.finished} after {o.ended - o.started:.1f}s: {o.error}"
        for o in bad[:10]
    )
    assert not bad, f"{figures}\n{detail}\n" + "\n".join(stack.lines[-10:]) + "\n" + _envoy_retry_stats(stack)
    kills = [at for what, at in run.events if what == "kill-epp"]
    lost = [o for o in run.outcomes if run.lost_with_killed_epp(o)]
    # when each lost request began and ended against the kill, and what Envoy said of it
    lost_detail = "\n".join(
        f"started {o.started - kills[0]:+.3f}s ended {o.ended - kills[0]:+.3f}s: {o.error}" for o in lost[:10]
    )
    assert len(lost) <= chaos.MAX_LOST_PER_EPP_KILL * len(kills), (
        f"{figures}\n{lost_detail}\n" + _envoy_retry_stats(stack)
    )
    # the SIGKILLed engine's own requests end with an error, promptly, never hang
    for o in run.outcomes:
        assert o.ended - o.started < chaos.REQUEST_TIMEOUT_S - 1, o


def test_sigkill_one_epp_replica(stack: UpProcess) -> None:
    _assert_done(_run(stack, "kill-epp"), stack)
    stack.wait_for_line(r"epp-1 restarted", timeout=30)


def test_sigstop_one_epp_replica(stack: UpProcess) -> None:
    _assert_done(_run(stack, "stop-epp"), stack)


def test_sigterm_one_engine_drains_without_losing_a_request(stack: UpProcess) -> None:
    _assert_done(_run(stack, "term-engine"), stack)
    stack.wait_for_line(rf"engine-{ENGINES - 1} restarted", timeout=30)


def test_sigkill_one_engine(stack: UpProcess) -> None:
    run = _run(stack, "kill-engine")
    _assert_done(run, stack)
    stack.wait_for_line(r"engine-0 restarted", timeout=30)


@pytest.mark.skipif(
    os.environ.get("KVGATE_CHAOS_ALL") != "1",
    reason="opt-in to keep the default suite's time (~20 s more); KVGATE_CHAOS_ALL=1 runs it. "
    "Its 503 connection-refused losses were Envoy's default 3-retries-in-flight circuit breaker",
)
def test_all_faults_in_one_run(stack: UpProcess) -> None:
    _assert_done(_run(stack, "all"), stack)
    # and the whole stack is back afterwards, every victim restarted on its own port
    chaos.wait_recovered(stack.log_dir / "stack.json", ENGINES)

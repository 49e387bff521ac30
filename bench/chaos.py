"""Chaos run against `kvgate up --simulate`: streaming load while EPP replicas and engines are
killed, frozen and drained; prints per-fault figures.

    python bench/chaos.py                      # each fault alone, then all in one run, 30 s each
    python bench/chaos.py --fault kill-engine --duration 15

Per request: ok (200, a finish_reason and [DONE]), failed (non-200 or connection error before
the stream ended), truncated (200 but no finish_reason/[DONE]). A failed or truncated request
whose x-kvgate-upstream is the SIGKILLed engine and that was in flight when it died is expected
to fail (its stream dies with it) and is counted apart; anything else failing is a fault of the
stack. Also used by e2e/test_chaos.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REQUEST_TIMEOUT_S = 30.0  # a request still open after this is a hang, counted as failed


@dataclass
class Outcome:
    started: float
    ended: float = 0.0
    status: int | None = None
    upstream: str | None = None
    done: bool = False  # saw data: [DONE]
    finished: bool = False  # saw a finish_reason
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finished and self.error is None

    @property
    def truncated(self) -> bool:
        return self.status == 200 and not self.ok

    @property
    def failed(self) -> bool:
        return self.status != 200


# How long after the SIGKILL of an EPP replica a new request may still be sent to it: until the
# first refused connection ejects it (or a 0.5 s health check fails it), plus clock slack.
EPP_EJECT_WINDOW_S = 0.5
# At most this many requests may be lost per EPP replica killed. Envoy retries an ext_proc stream
# that the dying replica reset or refused on the other replica (gateway/envoy_config.py's
# _epp_stream_retry), and FailOpen cannot save one whose body it already streamed to the replica
# (FULL_DUPLEX_STREAMED: it answers 503 ext_proc_error). One such 503 in ~400 requests was seen
# once in CI (2026-12-06) and never in 11 runs here, with or without two CPU hogs; its cause is not
# pinned (the assertion prints its timing, error code and Envoy's retry counters). A request that
# the replica had already answered is safe: tested by killing both replicas while the picked
# engine was frozen (200 once it thawed). Counted apart, so a regression shows its fault.
MAX_LOST_PER_EPP_KILL = 1


@dataclass
class Killed:
    """An engine SIGKILLed at `at` (monotonic): requests it was serving then may fail."""

    address: str  # host:port, as x-kvgate-upstream names it
    at: float


@dataclass
class Run:
    fault: str
    outcomes: list[Outcome] = field(default_factory=list)
    killed: list[Killed] = field(default_factory=list)
    events: list[tuple[str, float]] = field(default_factory=list)  # (what, monotonic time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def excused(self, o: Outcome) -> bool:
        """Served by a SIGKILLed engine while it died, or picked by a SIGKILLed EPP replica while
        it died (bounded by MAX_LOST_PER_EPP_KILL)."""
        if any(o.upstream == k.address and o.started <= k.at <= o.ended for k in self.killed):
            return True
        return self.lost_with_killed_epp(o)

    def lost_with_killed_epp(self, o: Outcome) -> bool:
        """A clean 503 from the gateway's ext_proc for a request whose pick went to the replica
        as it was killed (in flight on it, or opened on it before Envoy ejected it). Envoy now
        retries such a stream on the other replica (see MAX_LOST_PER_EPP_KILL); they are
        counted apart to tell a regression's cause. Any such failure later than
        EPP_EJECT_WINDOW_S after the kill is not excused: the gateway should have dropped it."""
        return (
            o.status == 503
            and "ext_proc_error" in (o.error or "")
            and any(
                what == "kill-epp" and at - 30 <= o.started <= at + EPP_EJECT_WINDOW_S and o.ended <= at + 1.0
                for what, at in self.events
            )
        )

    def figures(self) -> dict[str, object]:
        outs = list(self.outcomes)
        bad = [o for o in outs if not o.ok]
        return {
            "fault": self.fault,
            "requests": len(outs),
            "ok": sum(o.ok for o in outs),
            "failed": sum(o.failed for o in bad if not self.excused(o)),
            "truncated": sum(o.truncated for o in bad if not self.excused(o)),
            "lost_with_killed_engine": sum(self.excused(o) and not self.lost_with_killed_epp(o) for o in bad),
            "lost_with_killed_epp": sum(self.lost_with_killed_epp(o) for o in bad),
            "slowest_error_s": round(max((o.ended - o.started for o in bad), default=0.0), 2),
            # when the unexcused failures began, seconds after each fault struck
            "failures_after_fault_s": {
                what: [round(o.started - at, 1) for o in self.unexcused()][:3]
                + ([round(self.unexcused()[-1].started - at, 1)] if self.unexcused() else [])
                for what, at in self.events
            },
        }

    def unexcused(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok and not self.excused(o)]


def one_request(client: httpx.Client, gateway: str, model: str, i: int) -> Outcome:
    o = Outcome(started=time.monotonic())
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"chaos request {i} " + "word " * (i % 40)}],
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with client.stream("POST", gateway + "/v1/chat/completions", json=body) as r:
            o.status = r.status_code
            o.upstream = r.headers.get("x-kvgate-upstream")
            if r.status_code != 200:
                o.error = r.read().decode("utf-8", "replace")[:200]
            else:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        o.done = True
                    elif line.startswith("data: ") and '"finish_reason":"' in line.replace(" ", ""):
                        o.finished = True
    except httpx.HTTPError as exc:
        o.error = f"{type(exc).__name__}: {exc}"
    o.ended = time.monotonic()
    return o


def load(stack_json: Path, duration_s: float, clients: int, fault: Callable[[Run], None], name: str) -> Run:
    """`clients` closed-loop streaming clients for `duration_s`; `fault(run)` runs meanwhile."""
    info = json.loads(stack_json.read_text())
    run = Run(name)
    deadline = time.monotonic() + duration_s
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0)

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=timeout) as client:
            i = c
            while time.monotonic() < deadline:
                o = one_request(client, info["gateway_url"], info["model"], i)
                with run.lock:
                    run.outcomes.append(o)
                i += clients

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    fault_thread = threading.Thread(target=fault, args=(run,), daemon=True)
    fault_thread.start()
    for t in threads:
        t.join(timeout=duration_s + REQUEST_TIMEOUT_S + 10)
    fault_thread.join(timeout=30)
    return run


# -- faults: each reads stack.json when it strikes (a restart changes pids) -------------------
def _info(stack_json: Path) -> dict:
    return json.loads(stack_json.read_text())


def kill_epp(stack_json: Path, after_s: float) -> Callable[[Run], None]:
    def fault(run: Run) -> None:
        time.sleep(after_s)
        os.kill(_info(stack_json)["epp_pids"][-1], signal.SIGKILL)
        run.events.append(("kill-epp", time.monotonic()))

    return fault


def stop_epp(stack_json: Path, after_s: float, frozen_s: float) -> Callable[[Run], None]:
    def fault(run: Run) -> None:
        time.sleep(after_s)
        pid = _info(stack_json)["epp_pids"][-1]
        os.kill(pid, signal.SIGSTOP)
        run.events.append(("stop-epp", time.monotonic()))
        try:
            time.sleep(frozen_s)
        finally:
            os.kill(pid, signal.SIGCONT)

    return fault


def term_engine(stack_json: Path, after_s: float) -> Callable[[Run], None]:
    def fault(run: Run) -> None:
        time.sleep(after_s)
        os.kill(_info(stack_json)["engine_pids"][-1], signal.SIGTERM)
        run.events.append(("term-engine", time.monotonic()))

    return fault


def kill_engine(stack_json: Path, after_s: float) -> Callable[[Run], None]:
    def fault(run: Run) -> None:
        time.sleep(after_s)
        info = _info(stack_json)
        address = info["engine_urls"][0].removeprefix("http://")
        now = time.monotonic()
        os.kill(info["engine_pids"][0], signal.SIGKILL)
        run.killed.append(Killed(address, now))
        run.events.append(("kill-engine", now))

    return fault


def all_faults(stack_json: Path, duration_s: float) -> Callable[[Run], None]:
    """Every fault in one run, staggered over the first two thirds of it."""
    step = duration_s / 6
    parts = [
        kill_epp(stack_json, step),
        stop_epp(stack_json, 2 * step, min(10.0, step * 2)),
        term_engine(stack_json, 3 * step),
        kill_engine(stack_json, 4 * step),
    ]

    def fault(run: Run) -> None:
        threads = [threading.Thread(target=p, args=(run,), daemon=True) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=duration_s + 30)

    return fault


def fault_for(name: str, stack_json: Path, duration_s: float, frozen_s: float) -> Callable[[Run], None]:
    at = duration_s / 4
    return {
        "kill-epp": lambda: kill_epp(stack_json, at),
        "stop-epp": lambda: stop_epp(stack_json, at, frozen_s),
        "term-engine": lambda: term_engine(stack_json, at),
        "kill-engine": lambda: kill_engine(stack_json, at),
        "all": lambda: all_faults(stack_json, duration_s),
    }[name]()


FAULTS = ("kill-epp", "stop-epp", "term-engine", "kill-engine", "all")


def wait_recovered(stack_json: Path, engines: int, timeout_s: float = 60.0) -> None:
    """Every child alive again (restarted ones included) and the gateway serving."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            info = _info(stack_json)
            pids = [*info["engine_pids"], *info["epp_pids"], info["envoy_pid"]]
            states = [Path(f"/proc/{p}/stat").read_text().split()[2] for p in pids]
            if all(s not in ("Z", "T") for s in states) and len(info["engine_pids"]) == engines:
                healthy = all(
                    httpx.get(u + "/health", timeout=2).status_code == 200 for u in info["engine_urls"]
                )
                if healthy:
                    return
            last = f"states {states}"
        except (OSError, ValueError, httpx.HTTPError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise TimeoutError(f"the stack did not recover within {timeout_s}s ({last})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--fault", choices=(*FAULTS, "each"), default="each", help="each: every fault alone, then all"
    )
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    ap.add_argument("--clients", type=int, default=20, help="concurrent streaming clients")
    ap.add_argument("--frozen", type=float, default=10.0, help="seconds an EPP replica stays SIGSTOPped")
    ap.add_argument("--engines", type=int, default=3)
    args = ap.parse_args(argv)

    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    up = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvgate", "up", "--simulate", "--quiet", "--port", "0", "--base-port", "0",
         "--engines", str(args.engines), "--epp-replicas", "2", "--expose-upstream-header",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    stack_json = log_dir / "stack.json"
    try:
        deadline = time.monotonic() + 120
        while not stack_json.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                print(up.stdout.read() if up.stdout else "", file=sys.stderr)
                return 1
            time.sleep(0.2)
        names = FAULTS if args.fault == "each" else (args.fault,)
        print(f"{args.clients} streaming clients, {args.duration:.0f}s per run, logs in {log_dir}")
        for name in names:
            wait_recovered(stack_json, args.engines)
            run = load(
                stack_json,
                args.duration,
                args.clients,
                fault_for(name, stack_json, args.duration, args.frozen),
                name,
            )
            print(json.dumps(run.figures()))
            for o in run.unexcused()[:5]:
                print(
                    f"    {o.status} upstream={o.upstream} done={o.done} finish={o.finished} error={o.error}"
                )
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())

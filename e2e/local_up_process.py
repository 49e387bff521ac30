"""Runs `kvgate up` as a user would: a subprocess whose output is collected line by line.

Shared by e2e/test_local_*.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvgate.bench.engine_metrics import parse_samples

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0


@dataclass
class UpProcess:
    """A running `kvgate up` subprocess, its output collected line by line."""

    popen: subprocess.Popen[str]
    log_dir: Path
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def wait_for_line(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                line = self.lines[seen]
                seen += 1
                if rx.search(line):
                    return line
            if self.popen.poll() is not None and seen >= len(self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}; output so far:\n" + "\n".join(self.lines[-40:]))

    @property
    def stack(self) -> dict:
        return json.loads((self.log_dir / "stack.json").read_text())

    def interrupt(self, timeout: float = 30.0) -> int:
        self.popen.send_signal(signal.SIGINT)
        try:
            return self.popen.wait(timeout=timeout)
        finally:
            if self.reader is not None:
                self.reader.join(timeout=5)


def start_up(tmp: Path, *extra: str) -> UpProcess:
    log_dir = tmp / "logs"
    popen = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "kvgate",
            "up",
            "--port",
            "0",
            "--base-port",
            "0",
            "--log-dir",
            str(log_dir),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a stray Ctrl-C in the test runner's terminal must not reach it
    )
    up = UpProcess(popen, log_dir)

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            up.lines.append(line.rstrip("\n"))

    up.reader = threading.Thread(target=pump, daemon=True)
    up.reader.start()
    return up


def stop_up(up: UpProcess) -> None:
    if up.popen.poll() is None:
        try:
            up.interrupt()
        except subprocess.TimeoutExpired:
            os.killpg(up.popen.pid, signal.SIGKILL)
            up.popen.wait(timeout=10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it holds no ports and will be reaped by init.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def engine_gauges(engine_url: str) -> dict[str, float]:
    return parse_samples(httpx.get(engine_url + "/metrics", timeout=5).text)

"""Runs `kvgate up` as a user would: a subprocess whose output is collected line by line.

Not a `Process` of `kvgate.testing.processes`: this is the CLI under test, run from a terminal's
point of view (its own session, Ctrl-C as SIGINT, its console output read as it comes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvgate.bench.engine_metrics import parse_samples
from kvgate.testing.polling import NotReached, eventually

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0


@dataclass
class UpProcess:
    """A running `kvgate up` subprocess, its output collected line by line."""

    popen: subprocess.Popen[str]
    log_dir: Path
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    name = "kvgate up"

    def alive(self) -> bool:
        """Running, or its last lines not read yet."""
        return self.popen.poll() is None or (self.reader is not None and self.reader.is_alive())

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def wait_for_line(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> str:
        """The first line matching ``pattern`` (searched from the start of its output)."""
        rx = re.compile(pattern)
        seen = 0

        def match() -> str | None:
            nonlocal seen
            while seen < len(self.lines):
                line = self.lines[seen]
                seen += 1
                if rx.search(line):
                    return line
            return None

        try:
            line = eventually(match, timeout, f"a line matching {pattern!r}", watch=[self])
        except NotReached:
            line = match()  # written just before it exited?
            if line is None:
                raise
        assert line is not None
        return line

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


def engine_gauges(engine_url: str) -> dict[str, float]:
    return parse_samples(httpx.get(engine_url + "/metrics", timeout=5).text)

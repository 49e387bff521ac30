"""Runs the stack's processes: one process group each, logs prefixed and teed to files, clean stop.

Each child gets its own session (so a signal to its group reaches anything it spawns) and,
on Linux, a parent-death signal, so even a `kill -9` of the supervisor leaves no orphan
engines holding ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

_PR_SET_PDEATHSIG = 1
TAIL_LINES = 40


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()  # loaded before any fork: the child must not import or allocate


def _child_setup() -> None:
    # Runs in the child between fork and exec: new session + die with the parent.
    os.setsid()
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # e.g. "engine-0"; prefixes its log lines
    argv: Sequence[str]
    env: dict[str, str] | None = None  # added to the supervisor's environment
    cwd: str | None = None


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    _tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    _reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def tail(self, lines: int = 15) -> list[str]:
        """The last log lines (from memory when echoing, else from its log file)."""
        if self._reader is not None:
            self._reader.join(timeout=1.0)
            return list(self._tail)[-lines:]
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]


class Supervisor:
    """Starts, watches and stops a set of named processes."""

    def __init__(self, log_dir: Path, echo: TextIO | None = None) -> None:
        self.log_dir = log_dir
        self.echo = echo  # where prefixed log lines go (None: files only)
        self.processes: list[ManagedProcess] = []
        self._echo_lock = threading.Lock()
        self._width = 8

    def start(self, spec: ProcessSpec) -> ManagedProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._width = max(self._width, len(spec.name) + 2)
        log_path = self.log_dir / f"{spec.name}.log"
        proc = ManagedProcess(spec, self._spawn(spec, log_path, "wb"), log_path, time.monotonic())
        self._start_reader(proc, "wb")
        self.processes.append(proc)
        return proc

    def restart(self, proc: ManagedProcess) -> None:
        """Start an exited process again, in place (same object, new pid; its log is appended to)."""
        if proc.exit_code() is None:
            raise RuntimeError(f"{proc.name} is still running")
        _signal_group(proc, signal.SIGKILL)  # whatever the dead leader left in its group
        if proc._reader is not None:
            proc._reader.join(timeout=2.0)
        if proc.popen.stdout is not None:
            proc.popen.stdout.close()
        proc.popen = self._spawn(proc.spec, proc.log_path, "ab")
        proc.started_at = time.monotonic()
        self._start_reader(proc, "ab")

    def _spawn(self, spec: ProcessSpec, log_path: Path, mode: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(spec.env or {})}
        if self.echo is None:
            with log_path.open(mode) as log:
                return subprocess.Popen(
                    list(spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=spec.cwd,
                    preexec_fn=_child_setup,
                )
        return subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=spec.cwd,
            preexec_fn=_child_setup,
        )

    def _start_reader(self, proc: ManagedProcess, mode: str) -> None:
        if self.echo is None:
            proc._reader = None
            return
        proc._reader = threading.Thread(
            target=self._pump, args=(proc, proc.popen, mode), name=f"log-{proc.name}", daemon=True
        )
        proc._reader.start()

    def _pump(self, proc: ManagedProcess, popen: subprocess.Popen[bytes], mode: str) -> None:
        assert popen.stdout is not None
        prefix = f"[{proc.name}]"
        with proc.log_path.open(mode) as log:
            for raw in iter(popen.stdout.readline, b""):
                log.write(raw)
                log.flush()
                # A progress bar redraws itself with carriage returns: show where it ended, not
                # every redraw glued into one line (the log file keeps the bytes as written).
                line = raw.decode("utf-8", "replace").rstrip("\r\n").rsplit("\r", 1)[-1]
                proc._tail.append(line)
                if self.echo is not None:
                    with self._echo_lock:
                        try:
                            self.echo.write(f"{prefix:<{self._width}} {line}\n")
                            self.echo.flush()
                        except (OSError, ValueError):
                            pass  # the console went away; the file still has it

    def say(self, message: str) -> None:
        """A supervisor line in the same stream as the children's logs."""
        if self.echo is None:
            return
        with self._echo_lock:
            self.echo.write(message + "\n")
            self.echo.flush()

    def exited(self) -> list[ManagedProcess]:
        return [p for p in self.processes if p.exit_code() is not None]

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every group (newest first: gateway before engines), then SIGKILL stragglers."""
        for proc in reversed(self.processes):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in reversed(self.processes):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                proc.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=5.0)
            # The leader is gone; anything it left in its group goes too.
            _signal_group(proc, signal.SIGKILL)
        for proc in self.processes:
            if proc._reader is not None:
                proc._reader.join(timeout=2.0)
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()


def describe_exit(code: int) -> str:
    """'code 3' or 'signal SIGKILL' (Popen reports death by signal N as -N)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff for restarts, and when to stop trying.

    A child that exits is restarted after `initial_backoff_s`, doubled for each further exit
    within `window_s` of the last restart, capped at `max_backoff_s`. If it exits
    `max_restarts` + 1 times within `window_s` it is crash-looping: restarting it again would
    only hide the fault, so the supervisor gives up and the stack exits non-zero.
    """

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 60.0


class Restarter:
    """Decides, per exited child, when to restart it or that it is crash-looping."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._exits: dict[str, deque[float]] = {}
        self._due: dict[str, float] = {}  # name -> monotonic time of the pending restart

    def on_exit(self, name: str, now: float) -> float | None:
        """Record an exit; the delay before restarting it, or None when it is crash-looping."""
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while exits and now - exits[0] > self.policy.window_s:
            exits.popleft()
        if len(exits) > self.policy.max_restarts:
            return None
        delay = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** (len(exits) - 1))
        self._due[name] = now + delay
        return delay

    def due(self, name: str, now: float) -> bool:
        """True once (then forgotten) when the pending restart of `name` is due."""
        at = self._due.get(name)
        if at is None or now < at:
            return False
        del self._due[name]
        return True

    def pending(self, name: str) -> bool:
        return name in self._due


def _signal_group(proc: ManagedProcess, sig: signal.Signals) -> None:
    # The child called setsid, so its pid is its process-group id, and that id stays reserved
    # while any member of the group lives, so this reaches leftovers even after the leader died.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)

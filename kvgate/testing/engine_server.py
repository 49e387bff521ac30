"""`kvgate engine serve` as a process on a port it picks itself (``--port 0``): the tests learn
its address, KV-event endpoints and topic from its "serving" log line, as a user would."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvgate.testing.polling import eventually
from kvgate.testing.processes import KVGATE, Process, cpu_seconds, free_port

STARTED = re.compile(r"kvgate engine serving (\S+).* on http://(\S+?)(?:,|$)", re.MULTILINE)
KV = re.compile(r"kv events (\S+)(?: replay (\S+))? topic (\S+)")
START_TIMEOUT_S = 60.0


@dataclass
class EngineProcess:
    process: Process
    base_url: str = ""
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str | None = None
    cpu_at_ready: float = field(default=0.0)  # CPU seconds used when it was seen "serving"

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.popen

    @property
    def log(self) -> str:
        """Everything it wrote (stdout and stderr) so far."""
        try:
            return self.process.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def started(self) -> bool:
        """Whether it logged that it serves; fills in its address and KV endpoints when it has."""
        if self.base_url:
            return True
        log = self.log
        log = log[: log.rfind("\n") + 1]  # whole lines only
        m = STARTED.search(log)
        if m is None:
            return False
        self.cpu_at_ready = cpu_seconds(self.proc.pid)
        line = log[log.rfind("\n", 0, m.start()) + 1 :].split("\n", 1)[0]
        if kv := KV.search(line):
            self.kv_endpoint, self.replay_endpoint, self.topic = kv.group(1), kv.group(2), kv.group(3)
        self.base_url = f"http://{m.group(2)}"
        return True

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{labels sorted}` -> value, plus `name` -> value of its first series."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
                out.setdefault(sample.name, sample.value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """``sig`` to the engine, SIGKILL if it has not exited within ``timeout``; its exit code."""
        popen = self.process.popen
        if popen.poll() is None:
            popen.send_signal(sig)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
        self.process.stop()  # anything it left in its process group
        return popen.returncode


def subscribe_kv_events(endpoint: str, poke: Callable[[], object], topic: bytes = b"kv@") -> Any:
    """A ZMQ SUB socket on an engine's KV-event publisher that is known to receive.

    A PUB socket drops what it publishes until a new subscription has reached it: ``poke``
    (a request that stores new blocks) is repeated until an event arrives, then what the pokes
    produced is drained, so the caller sees only what it causes itself.
    """
    import zmq

    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)

    def arrived() -> bool:
        if sub.poll(100):
            return True
        poke()
        return False

    try:
        eventually(arrived, 10, f"KV events from {endpoint}", interval=0)
    except BaseException:
        sub.close()
        raise
    while sub.poll(200):
        sub.recv_multipart()
    return sub


def spawn(log_dir: Path, *args: str) -> EngineProcess:
    """Starts `kvgate engine serve --port 0 ARGS` without waiting (see `wait_started`), logging
    to a file in ``log_dir``. No drain grace unless ARGS ask for one (they come later and win):
    teardown stays fast."""
    argv = [*KVGATE, "engine", "serve", "--port", "0", "--drain-grace-period", "0", *args]
    name = f"engine-{free_port()}"  # a unique log name; the engine picks its own port
    return EngineProcess(Process(name, argv, log_dir / f"{name}.log").start())


def wait_started(*engines: EngineProcess, timeout: float = START_TIMEOUT_S) -> None:
    """Until every one logged that it serves (each one's CPU time is taken as it is seen)."""
    eventually(
        lambda: all([e.started() for e in engines]),  # a list: every one is looked at each time
        timeout,
        f"{len(engines)} engine(s) serving",
        watch=[e.process for e in engines],
    )


def launch(log_dir: Path, *args: str, timeout: float = START_TIMEOUT_S) -> EngineProcess:
    """`spawn` and `wait_started`: a serving engine."""
    eng = spawn(log_dir, *args)
    try:
        wait_started(eng, timeout=timeout)
    except BaseException:
        eng.stop(signal.SIGKILL)
        raise
    return eng

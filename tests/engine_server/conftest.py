"""Real `kvgate engine serve` processes on free ports, shared by the engine-server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTED = re.compile(r"kvgate engine serving (\S+).* on http://(\S+?)(?:,|$)")
KV = re.compile(r"kv events (\S+)(?: replay (\S+))? topic (\S+)")
API_KEY = "test-key"


@dataclass
class EngineProcess:
    proc: subprocess.Popen[str]
    base_url: str = ""
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str | None = None
    lines: list[str] = field(default_factory=list)
    cpu_at_ready: float = 0.0  # CPU seconds the process had used when it logged "serving"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{labels sorted}` -> value, plus `name` -> value of its first series."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
                out.setdefault(sample.name, sample.value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def cpu_seconds(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launch(*args: str, timeout: float = 60) -> EngineProcess:
    # no drain grace unless a test asks for it (args come later and win): teardown stays fast
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "kvgate",
        "engine",
        "serve",
        "--port",
        "0",
        "--drain-grace-period",
        "0",
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    eng = EngineProcess(proc)
    started = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            eng.lines.append(line)
            m = STARTED.search(line)
            if m and not started.is_set():
                eng.base_url = f"http://{m.group(2)}"
                eng.cpu_at_ready = cpu_seconds(proc.pid)
                if kv := KV.search(line):
                    eng.kv_endpoint, eng.replay_endpoint, eng.topic = kv.group(1), kv.group(2), kv.group(3)
                started.set()
        started.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not started.wait(0.05):
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"engine did not start in {timeout}s:\n{eng.log}")
    if not eng.base_url:
        proc.wait(5)
        raise RuntimeError(f"engine exited with {proc.returncode}:\n{eng.log}")
    return eng


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def make(*args: str) -> EngineProcess:
        eng = launch(*args)
        started.append(eng)
        return eng

    yield make
    for eng in started:
        eng.stop(signal.SIGKILL)


# The shared simulated engine: fast timing, KV events with replay, an API key, tiny block pool
# so block accounting is easy to observe.
SIM_ARGS = (
    "--simulate",
    "--sim-itl", "0.002",
    "--sim-itl-per-seq", "0.0001",
    "--sim-prefill-time-per-token", "0.00001",
    "--sim-kv-blocks", "256",
    "--api-key", API_KEY,
    "--served-model-name", "sim-model", "sim-alias",
    "--max-model-len", "1024",
    "--kv-events-endpoint", "tcp://127.0.0.1:*",
    "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
)  # fmt: skip


@pytest.fixture(scope="session")
def sim_engine() -> Iterator[EngineProcess]:
    eng = launch(*SIM_ARGS)
    yield eng
    eng.stop(signal.SIGKILL)

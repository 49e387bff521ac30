"""Start kvgate's processes (simulated engines, the EPP, Envoy) on loopback, free ports.

Used by the e2e tests and the EPP latency bench; the local stack (`kvgate up`) can start
processes the same way. Every process logs to a file in ``log_dir`` and is stopped with
SIGTERM, then SIGKILL, by its own pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KVGATE = [sys.executable, "-P", "-m", "kvgate"]  # -P: never import from the repo root by accident
ENVOY = str(BIN / "envoy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class StartError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the process dies without any shutdown (a crashed pod)."""
        if self.alive():
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(5)

    def stop(self, timeout: float = 5.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def wait_until(check, timeout: float, what: str, proc: Process | None = None, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise StartError(f"{what}: process exited early\n{proc.log_tail()}")
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval)
    raise StartError(f"{what}: not ready after {timeout}s ({last})\n{proc.log_tail() if proc else ''}")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class Engine:
    proc: Process
    port: int
    kv_events: str
    kv_replay: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """Sum of every series of ``name`` on the engine's /metrics."""
        _, text = http_get(f"http://{self.address}/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_ready(self, timeout: float = 60) -> Engine:
        wait_until(
            lambda: http_get(f"http://{self.address}/health")[0] == 200,
            timeout,
            f"engine {self.address}",
            self.proc,
        )
        return self


def start_engine(log_dir: Path, *extra: str, name: str | None = None) -> Engine:
    """A simulated engine (real scheduler and KV cache, no model) with KV events and replay."""
    port, pub, replay = free_ports(3)
    kv_events, kv_replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    argv = [
        *KVGATE,
        "engine",
        "serve",
        "--simulate",
        "--port",
        str(port),
        "--kv-events-endpoint",
        kv_events,
        "--kv-events-replay-endpoint",
        kv_replay,
        "--drain-grace-period",  # teardown stays fast; a test that wants a grace passes its own
        "0",
        *extra,
    ]
    proc = Process(name or f"engine-{port}", argv, log_dir / f"engine-{port}.log").start()
    return Engine(proc, port, kv_events, kv_replay)


@dataclass
class Epp:
    proc: Process
    grpc_port: int
    health_port: int
    metrics_port: int
    secure: bool

    def metrics_text(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def wait_ready(self, timeout: float = 60) -> Epp:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        def ready() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1
                )
                return resp.status == health_pb2.HealthCheckResponse.SERVING

        wait_until(ready, timeout, "epp", self.proc, interval=0.1)
        return self


def start_epp(
    log_dir: Path, engines: list[Engine], *extra: str, secure: bool = False, kv_events: bool = True
) -> Epp:
    grpc_port, health_port, metrics_port = free_ports(3)
    argv = [
        *KVGATE,
        "epp",
        "serve",
        "--endpoints",
        ",".join(e.address for e in engines),
        "--grpc-port",
        str(grpc_port),
        "--grpc-health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        f"--secure-serving={'true' if secure else 'false'}",
    ]
    if kv_events:
        argv += [
            "--kv-events-endpoints",
            ",".join(e.kv_events for e in engines),
            "--kv-replay-endpoints",
            ",".join(e.kv_replay for e in engines),
        ]
    proc = Process(f"epp-{grpc_port}", [*argv, *extra], log_dir / f"epp-{grpc_port}.log").start()
    return Epp(proc, grpc_port, health_port, metrics_port, secure)


@dataclass
class Envoy:
    proc: Process
    port: int
    admin_port: int
    config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30) -> Envoy:
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{self.admin_port}/ready")[1].strip() == "LIVE",
            timeout,
            "envoy",
            self.proc,
        )
        return self

    def wait_epp_healthy(self, healthy: bool = True, timeout: float = 15) -> None:
        """Until Envoy's own health check sees the EPP cluster (un)healthy."""

        def check() -> bool:
            text = http_get(f"http://127.0.0.1:{self.admin_port}/clusters")[1]
            lines = [
                line for line in text.splitlines() if line.startswith("epp::") and "::health_flags::" in line
            ]
            return bool(lines) and (lines[0].endswith("::healthy") == healthy)

        wait_until(check, timeout, f"envoy sees epp {'healthy' if healthy else 'unhealthy'}", self.proc)


def start_envoy(log_dir: Path, epp_port: int, **kwargs: Any) -> Envoy:
    """Envoy in front of the EPP, its bootstrap from ``kvgate.epp.envoy_config.build_bootstrap``."""
    from kvgate.epp.envoy_config import build_bootstrap

    port, admin = free_ports(2)
    # tests read which engine answered; the attack suite asks for the default (hidden) instead
    kwargs.setdefault("expose_upstream_header", True)
    config = build_bootstrap(port, "127.0.0.1", epp_port, admin_port=admin, **kwargs)
    path = log_dir / f"envoy-{port}.json"
    path.write_text(json.dumps(config))
    argv = [
        ENVOY,
        "-c",
        str(path),
        "--log-level",
        "warn",
        "--concurrency",
        "1",
        "--use-dynamic-base-id",  # several Envoys on one host without shared-memory clashes
    ]
    proc = Process(f"envoy-{port}", argv, log_dir / f"envoy-{port}.log").start()
    return Envoy(proc, port, admin, config)


@contextmanager
def gateway_stack(
    log_dir: Path, engines: int = 2, **envoy_kwargs: Any
) -> Iterator[tuple[list[Engine], Epp, Envoy]]:
    """Simulated engines, the EPP (its default precise-prefix profile: it tokenizes every
    prompt) and Envoy in front, all ready; stopped on exit."""
    started = [start_engine(log_dir) for _ in range(engines)]
    procs = [e.proc for e in started]
    try:
        for e in started:
            e.wait_ready()
        epp = start_epp(log_dir, started)
        procs.append(epp.proc)
        envoy = start_envoy(log_dir, epp.grpc_port, **envoy_kwargs)
        procs.append(envoy.proc)
        epp.wait_ready()
        envoy.wait_ready()
        envoy.wait_epp_healthy()
        yield started, epp, envoy
    finally:
        stop_all(*procs)


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process, in KiB (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def slowloris_close_time(port: int, budget: float) -> float:
    """Seconds until the server closes a connection that sends one header byte every 0.5 s
    (inf if it is still open after `budget`)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=budget)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < budget:
            try:
                sock.sendall(b"X")
            except OSError:
                return time.monotonic() - t0
            sock.settimeout(0.5)
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0
        return float("inf")
    finally:
        sock.close()


def stop_all(*procs: Process) -> None:
    for p in procs:
        if p.alive():
            assert p.popen is not None
            p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()

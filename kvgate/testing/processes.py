"""kvgate's processes for tests and benches: simulated engines, the EPP and Envoy on loopback,
on free ports, each logging to a file.

Built on the local stack (`kvgate.local`): processes are spawned and stopped by its
`Supervisor` (own process group, parent-death signal, SIGTERM then SIGKILL), engines and EPPs
get the command lines `kvgate up` gives them (`engine_spec`, `epp_spec`), ports come from
`kvgate.local.ports`, Envoy is found by `find_envoy`, and readiness is checked as the stack
checks it. What tests add: one process at a time, started and awaited separately, so a test can
kill, restart or stall one of them.

A process is started from the thread that owns it for its whole life: the parent-death signal
fires when the thread that spawned it exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.local.ports import LOOPBACK, EppPorts, PortPlan
from kvgate.local.ports import free_ports as free_ports
from kvgate.local.stack import StackConfig, engine_spec, epp_spec, find_envoy, grpc_serving, kvgate_argv
from kvgate.local.supervisor import ManagedProcess, ProcessSpec, Supervisor
from kvgate.testing.polling import eventually

KVGATE = kvgate_argv()  # `python -P -m kvgate`: never imports from the repo root by accident


def run_kvgate(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`kvgate ARGS...` run to its end, its output captured as text (CLI usage and error tests)."""
    return subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def envoy_bin() -> str:
    return find_envoy()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class Process:
    """One process, logging (stdout and stderr) to ``log_path`` (a ``.log`` file)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None  # added to this process's environment
    _supervisor: Supervisor | None = field(default=None, repr=False)
    _managed: ManagedProcess | None = field(default=None, repr=False)

    def start(self) -> Process:
        """Starts it (again, appending to its log, if it ran before)."""
        if self.log_path.suffix != ".log":
            raise ValueError(f"{self.log_path}: the log file of a process ends in .log")
        if self._supervisor is None or self._managed is None:
            self._supervisor = Supervisor(self.log_path.parent)
            spec = ProcessSpec(name=self.log_path.stem, argv=self.argv, env=self.env, cwd="/")
            self._managed = self._supervisor.start(spec)
        else:
            self._supervisor.restart(self._managed)
        return self

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        assert self._managed is not None, f"{self.name} was never started"
        return self._managed.popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self._managed is not None and self._managed.exit_code() is None

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self._managed.tail(n)) if self._managed is not None else ""

    def kill(self) -> None:
        """SIGKILL: the process dies without any shutdown (a crashed pod)."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(5)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM to its group, SIGKILL after ``timeout``; nothing it spawned is left."""
        if self._supervisor is not None:
            self._supervisor.stop_all(timeout)


def stop_all(*procs: Process) -> None:
    """Stops them together: every one is told to stop before any is waited for."""
    for p in procs:
        if p.alive():
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.stop()


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_sum(text: str, name: str) -> float:
    """Sum of every series of ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Engine:
    proc: Process
    port: int
    kv_events: str  # tcp://host:port of its KV-event publisher ("" if it has none)
    kv_replay: str  # tcp://host:port of its KV-event replay socket ("" if it has none)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def metric(self, name: str) -> float:
        """Sum of every series of ``name`` on the engine's /metrics."""
        return metric_sum(http_get(f"http://{self.address}/metrics")[1], name)

    def wait_ready(self, timeout: float = 60) -> Engine:
        eventually(
            lambda: http_get(f"http://{self.address}/health")[0] == 200,
            timeout,
            f"engine {self.address} /health",
            watch=[self.proc],
        )
        return self


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def start_engine(log_dir: Path, *extra: str, name: str | None = None) -> Engine:
    """A simulated engine (real scheduler and KV cache, no model) with KV events and replay,
    started with the command line `kvgate up --simulate` gives its engines; ``extra`` flags
    come last and win. No drain grace unless ``extra`` asks for one: teardown stays fast."""
    port, pub, replay = free_ports(3)
    plan = PortPlan(gateway=0, envoy_admin=0, engines=(port,), kv_events=(pub,), kv_replay=(replay,), epps=())
    cfg = StackConfig(ports=plan, engines=1, simulate=True, engine_args=("--drain-grace-period", "0", *extra))
    proc = Process(name or f"engine-{port}", list(engine_spec(cfg, 0).argv), log_dir / f"engine-{port}.log")
    return Engine(proc.start(), port, f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{replay}")


@dataclass
class Epp:
    proc: Process
    grpc_port: int
    health_port: int
    metrics_port: int
    secure: bool

    def metrics_text(self) -> str:
        return http_get(f"http://{LOOPBACK}:{self.metrics_port}/metrics")[1]

    def wait_ready(self, timeout: float = 60) -> Epp:
        eventually(
            lambda: grpc_serving(f"{LOOPBACK}:{self.health_port}"),
            timeout,
            f"{self.proc.name} gRPC readiness",
            interval=0.1,
            watch=[self.proc],
        )
        return self


def start_epp(
    log_dir: Path, engines: list[Engine], *extra: str, secure: bool = False, kv_events: bool = True
) -> Epp:
    """The EPP with static discovery of ``engines``, started with `kvgate up`'s command line;
    ``extra`` flags come last. ``kv_events``: subscribe to the engines' KV events and replay
    (else it has none: the approximate prefix index only)."""
    ports = EppPorts(*free_ports(3))
    plan = PortPlan(
        gateway=0,
        envoy_admin=0,
        engines=tuple(e.port for e in engines),
        # none: the EPP is given empty KV-event and replay lists
        kv_events=tuple(_port_of(e.kv_events) for e in engines) if kv_events else (),
        kv_replay=tuple(_port_of(e.kv_replay) for e in engines) if kv_events else (),
        epps=(ports,),
    )
    secure_flag = ("--secure-serving=true",) if secure else ()  # the stack's EPPs serve plaintext
    cfg = StackConfig(ports=plan, engines=len(engines), epp_args=(*secure_flag, *extra))
    argv = list(epp_spec(cfg, 0).argv)
    proc = Process(f"epp-{ports.grpc}", argv, log_dir / f"epp-{ports.grpc}.log").start()
    return Epp(proc, ports.grpc, ports.health, ports.metrics, secure)


@dataclass
class Envoy:
    proc: Process
    port: int
    admin_port: int
    config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges, by name."""
        out = {}
        for line in http_get(f"{self.admin_url}/stats")[1].splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def wait_ready(self, timeout: float = 30) -> Envoy:
        eventually(
            lambda: http_get(f"{self.admin_url}/ready")[1].strip() == "LIVE",
            timeout,
            f"{self.proc.name} /ready",
            watch=[self.proc],
        )
        return self

    def wait_epp_healthy(self, healthy: bool = True, timeout: float = 15) -> None:
        """Until Envoy's own health check sees the EPP cluster (un)healthy."""

        def check() -> bool:
            text = http_get(f"{self.admin_url}/clusters")[1]
            lines = [
                line for line in text.splitlines() if line.startswith("epp::") and "::health_flags::" in line
            ]
            return bool(lines) and (lines[0].endswith("::healthy") == healthy)

        eventually(
            check, timeout, f"envoy sees the EPP {'healthy' if healthy else 'unhealthy'}", watch=[self.proc]
        )


def envoy_argv(config_path: Path) -> list[str]:
    return [
        envoy_bin(),
        "-c",
        str(config_path),
        "--log-level",
        "warn",
        "--concurrency",
        "1",
        "--use-dynamic-base-id",  # several Envoys on one host without shared-memory clashes
    ]


def start_envoy(log_dir: Path, epp_port: int, epp_health_port: int | None = None, **kwargs: Any) -> Envoy:
    """Envoy in front of the EPP, its bootstrap from ``kvgate.gateway.envoy_config.build_bootstrap``.
    ``epp_health_port``: health-check the EPP there (its threaded gRPC health port, as the chart
    and `kvgate up` do) rather than on its ext_proc port. ``kwargs``: ``GatewaySpec.one_pool``'s
    (the pool's ``epp_addresses``, default the EPP on ``epp_port``, ``pool_endpoints``... and
    GatewaySpec's settings)."""
    from kvgate.gateway.envoy_config import GatewaySpec, build_bootstrap

    if epp_health_port is not None:
        kwargs.setdefault("epp_health_ports", [epp_health_port])

    port, admin = free_ports(2)
    # tests read which engine answered; the attack suite asks for the default (hidden) instead
    kwargs.setdefault("expose_upstream_header", True)
    kwargs.setdefault("epp_addresses", [f"{LOOPBACK}:{epp_port}"])
    config = build_bootstrap(GatewaySpec.one_pool(listen_port=port, admin_port=admin, **kwargs))
    path = log_dir / f"envoy-{port}.json"
    path.write_text(json.dumps(config))
    proc = Process(f"envoy-{port}", envoy_argv(path), log_dir / f"envoy-{port}.log").start()
    return Envoy(proc, port, admin, config)


def wait_gateway(epp: Epp, envoy: Envoy) -> None:
    """Until the EPP serves, Envoy listens and its health checks have passed the EPP (before
    that, FailOpen would serve a first request without a pick)."""
    epp.wait_ready()
    envoy.wait_ready()
    envoy.wait_epp_healthy()


@contextmanager
def gateway_stack(
    log_dir: Path,
    engines: int = 2,
    engine_args: Sequence[str] = (),
    epp_args: Sequence[str] = (),
    epp_secure: bool = False,
    **envoy_kwargs: Any,
) -> Iterator[tuple[list[Engine], Epp, Envoy]]:
    """Simulated engines (each given ``engine_args``), the EPP (its default precise-prefix
    profile: it tokenizes every prompt; ``epp_args`` come last) and Envoy in front, all ready;
    stopped on exit."""
    started = [start_engine(log_dir, *engine_args) for _ in range(engines)]
    procs = [e.proc for e in started]
    try:
        for e in started:
            e.wait_ready()
        epp = start_epp(log_dir, started, *epp_args, secure=epp_secure)
        procs.append(epp.proc)
        envoy = start_envoy(log_dir, epp.grpc_port, epp.health_port, **envoy_kwargs)
        procs.append(envoy.proc)
        wait_gateway(epp, envoy)
        yield started, epp, envoy
    finally:
        stop_all(*procs)


@dataclass
class Prometheus:
    proc: Process
    url: str  # http://127.0.0.1:PORT

    def wait_ready(self, timeout: float = 30) -> Prometheus:
        eventually(
            lambda: http_get(f"{self.url}/-/ready", timeout=1)[0] == 200,
            timeout,
            "Prometheus ready",
            watch=[self.proc],
        )
        return self


def start_prometheus(log_dir: Path, binary: str, config: dict[str, Any]) -> Prometheus:
    """A real Prometheus (Debian's `prometheus`) on a free loopback port with ``config`` (written
    as JSON, which Prometheus reads as YAML) and its data under ``log_dir``."""
    port = free_port()
    config_path = log_dir / "prometheus.yml"
    config_path.write_text(json.dumps(config))
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={log_dir / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}",
    ]
    proc = Process("prometheus", argv, log_dir / "prometheus.log").start()
    return Prometheus(proc, f"http://{LOOPBACK}:{port}")


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process, in KiB (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> set[int]:
    """The pids of a process's live children."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


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


def slowloris_close_time(port: int, budget: float) -> float:
    """Seconds until the server closes a connection that sends one header byte every 0.5 s
    (inf if it is still open after `budget`)."""
    sock = socket.create_connection((LOOPBACK, port), timeout=budget)
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

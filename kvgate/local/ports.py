"""Loopback port planning for the local stack: every port named, checked free before anything starts."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections import deque
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


class PortBusyError(RuntimeError):
    """A port the stack needs is already taken (message names the port and its role)."""


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True if a server could listen on host:port now.

    SO_REUSEADDR like uvicorn, Envoy and grpc set it, so sockets lingering in TIME_WAIT from a
    previous run do not count as busy — only a live listener (or a bound socket) does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# Where planned ports come from: below the kernel's ephemeral range, which every outgoing
# connection draws from; a port handed out for port 0 comes from that range, and an outgoing
# connection of any process could take it between our check and the server's bind.
_PLANNED_LOW = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class _HandedOut:
    """Ports this process planned lately. A planned port stays unbound until its server starts,
    and a slow one (the EPP imports for seconds) can still be starting when the next plan is
    made: without this memory, Envoy planned after it could be given the same "free" port and
    take it first. Process-wide on purpose: every caller in the process shares the one port space."""

    def __init__(self, remember: int = 4096) -> None:
        self._order: deque[int] = deque()
        self._set: set[int] = set()
        self._remember = remember
        self._lock = threading.Lock()

    def __contains__(self, port: int) -> bool:
        with self._lock:
            return port in self._set

    def add(self, ports: list[int]) -> None:
        with self._lock:
            for port in ports:
                if port in self._set:
                    continue
                self._order.append(port)
                self._set.add(port)
                if len(self._order) > self._remember:
                    self._set.discard(self._order.popleft())


_handed_out = _HandedOut()


# Processes planning ports at the same time (two test workers, two `kvgate up`s) each remember
# only their own plans; giving each its own range keeps their plans apart.
PORT_RANGE_ENV = "KVGATE_PORT_RANGE"


def planned_range() -> tuple[int, int]:
    """Where planned ports come from, [low, high): $KVGATE_PORT_RANGE ("LOW-HIGH") if set, else
    from 20000 up to the kernel's ephemeral range."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if spec:
        try:
            low, high = (int(x) for x in spec.split("-"))
        except ValueError:
            raise PortBusyError(f"{PORT_RANGE_ENV}={spec!r}: expected LOW-HIGH, e.g. 20000-26000") from None
        if not 1024 <= low < high <= 65536:
            raise PortBusyError(f"{PORT_RANGE_ENV}={spec!r}: expected 1024 <= LOW < HIGH <= 65536")
        return low, high
    return _PLANNED_LOW, _ephemeral_low()


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Ports free right now (all distinct, none handed out lately by this process), from
    `planned_range()` where it leaves room."""
    low, high = planned_range()
    chosen: list[int] = []
    if high - low >= 1000:
        rng = random.Random()
        for _ in range(50 * count):
            port = rng.randrange(low, high)
            if port in chosen or port in _handed_out:
                continue
            if port_is_free(port, host) and _connect_free(port, host):
                chosen.append(port)
                if len(chosen) == count:
                    break
    if len(chosen) < count:
        chosen = _kernel_ports(count, host)
    _handed_out.add(chosen)
    return chosen


def _connect_free(port: int, host: str) -> bool:
    """Nothing listens there (port_is_free's SO_REUSEADDR bind can succeed beside a listener)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) != 0


def _kernel_ports(count: int, host: str) -> list[int]:
    sockets = []
    try:
        # all bound at once, so distinct; a few spare draws skip ports handed out lately
        for _ in range(count + 16):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        fresh = [p for p in (s.getsockname()[1] for s in sockets) if p not in _handed_out]
        ports = fresh if len(fresh) >= count else [s.getsockname()[1] for s in sockets]
        return ports[:count]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class EppPorts:
    """One EPP replica's ports."""

    grpc: int  # ext_proc (Envoy's EPP cluster points here)
    health: int  # gRPC health (readiness)
    metrics: int  # Prometheus


@dataclass(frozen=True)
class PortPlan:
    gateway: int
    envoy_admin: int
    engines: tuple[int, ...]
    kv_events: tuple[int, ...]
    kv_replay: tuple[int, ...]
    epps: tuple[EppPorts, ...]
    router: tuple[int, int] | None = None  # the model router's ext_proc and health ports (several pools)
    batch: int | None = None  # the batch service's HTTP port (`kvgate batch serve`); None: no batch service

    # The first replica's ports, where one address is asked for (stack.json, single-EPP users).
    @property
    def epp_grpc(self) -> int:
        return self.epps[0].grpc

    @property
    def epp_health(self) -> int:
        return self.epps[0].health

    @property
    def epp_metrics(self) -> int:
        return self.epps[0].metrics

    def named(self) -> list[tuple[str, int]]:
        """Every port with the role it plays, for checks and error messages."""
        roles = [("gateway (--port)", self.gateway), ("Envoy admin", self.envoy_admin)]
        for i, (http, pub, replay) in enumerate(
            zip(self.engines, self.kv_events, self.kv_replay, strict=True)
        ):
            roles += [
                (f"engine-{i} HTTP", http),
                (f"engine-{i} KV events", pub),
                (f"engine-{i} KV-event replay", replay),
            ]
        for i, epp in enumerate(self.epps):
            name = "EPP" if len(self.epps) == 1 else f"epp-{i}"
            roles += [(f"{name} ext-proc gRPC", epp.grpc), (f"{name} gRPC health", epp.health)]
            roles += [(f"{name} metrics", epp.metrics)]
        if self.router is not None:
            roles += [
                ("model router ext-proc gRPC", self.router[0]),
                ("model router gRPC health", self.router[1]),
            ]
        if self.batch is not None:
            roles.append(("batch service HTTP", self.batch))
        return roles

    def check_free(self) -> None:
        seen: dict[int, str] = {}
        for role, port in self.named():
            if not 0 < port < 65536:
                raise PortBusyError(f"port {port} for {role} is out of range; choose another --base-port")
            if port in seen:
                raise PortBusyError(f"port {port} is planned for both {seen[port]} and {role}")
            seen[port] = role
            if not port_is_free(port):
                hint = "--port" if role.startswith("gateway") else "--base-port (0 picks free ports)"
                raise PortBusyError(f"port {port} ({role}) is already in use; choose another {hint}")


def plan_ports(
    gateway: int,
    base_port: int,
    engines: int,
    epp_replicas: int = 1,
    model_router: bool = False,
    batch: bool = False,
) -> PortPlan:
    """Lay the stack's ports out from `base_port` (0: any free ports), gateway on `gateway`.

    From base_port: engine HTTP ports, then their KV-event ports, then their replay ports,
    then each EPP replica's gRPC, health and metrics ports, then Envoy's admin port, then (with
    `model_router`, for several pools) the model router's ext_proc and health ports, then (with
    `batch`) the batch service's HTTP port.
    """
    if engines < 1:
        raise ValueError("at least one engine is needed")
    if epp_replicas < 1:
        raise ValueError("at least one EPP replica is needed")
    routed = 3 * engines + 3 * epp_replicas + 1 + (2 if model_router else 0)
    needed = routed + (1 if batch else 0)
    if base_port == 0:
        ports = free_ports(needed + (1 if gateway == 0 else 0))
        if gateway == 0:
            gateway = ports.pop()
    else:
        ports = list(range(base_port, base_port + needed))
        if gateway == 0:
            gateway = free_ports(1)[0]
    n = engines
    return PortPlan(
        gateway=gateway,
        engines=tuple(ports[0:n]),
        kv_events=tuple(ports[n : 2 * n]),
        kv_replay=tuple(ports[2 * n : 3 * n]),
        epps=tuple(EppPorts(*ports[3 * n + 3 * r : 3 * n + 3 * r + 3]) for r in range(epp_replicas)),
        envoy_admin=ports[3 * n + 3 * epp_replicas],
        router=(ports[routed - 2], ports[routed - 1]) if model_router else None,
        batch=ports[routed] if batch else None,
    )

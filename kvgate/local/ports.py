"""Loopback port planning for the local stack: every port named, checked free before anything starts."""

from __future__ import annotations

import socket
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


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Ports the kernel considers free right now (all distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class PortPlan:
    gateway: int
    envoy_admin: int
    engines: tuple[int, ...]
    kv_events: tuple[int, ...]
    kv_replay: tuple[int, ...]
    epp_grpc: int
    epp_health: int
    epp_metrics: int

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
        roles += [("EPP ext-proc gRPC", self.epp_grpc), ("EPP gRPC health", self.epp_health)]
        roles += [("EPP metrics", self.epp_metrics)]
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


def plan_ports(gateway: int, base_port: int, engines: int) -> PortPlan:
    """Lay the stack's ports out from `base_port` (0: any free ports), gateway on `gateway`.

    From base_port: engine HTTP ports, then their KV-event ports, then their replay ports,
    then the EPP's gRPC, health and metrics ports, then Envoy's admin port.
    """
    if engines < 1:
        raise ValueError("at least one engine is needed")
    needed = 3 * engines + 4
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
        epp_grpc=ports[3 * n],
        epp_health=ports[3 * n + 1],
        epp_metrics=ports[3 * n + 2],
        envoy_admin=ports[3 * n + 3],
    )

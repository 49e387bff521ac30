"""gRPC health on its own port: liveness always; readiness and ext_proc once endpoints are known
and their KV-event state is replayed (each engine's replay bounded by the subscriber's timeout).

The health port is answered from threads of its own (``ThreadedHealthServer``), not from the
EPP's event loop: a loop saturated by picks answers seconds late, and Envoy's health check (1 s
timeout, two misses) then took an overloaded but working EPP for a dead one and failed every
request with no_healthy_upstream; kubelet's probes would restart it. A frozen process (SIGSTOP)
answers nothing from any thread and still fails at once; a loop that has made no progress for
``stall_s`` is reported NOT_SERVING on every service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvgate.epp.datastore import Datastore

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
# the service GIE's EPP reports readiness under: its chart's (and llm-d's) probes ask for it
GIE_READINESS = "inference-extension"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# A loop silent this long cannot answer an ext_proc message within Envoy's message timeout
# (GatewayLimits.epp_message_timeout_s, 10 s): the EPP is stuck, not busy.
DEFAULT_STALL_S = 10.0
TICK_S = 0.2


class EppHealth:
    def __init__(self, datastore: Datastore, stall_s: float = DEFAULT_STALL_S) -> None:
        self.servicer = HealthServicer()
        self.datastore = datastore
        self._ready: bool | None = None
        # the same statuses for a health service on another gRPC server (kvgate.epp.grpclib_server)
        self.statuses: dict[str, int] = {}
        self.stall_s = stall_s
        self.last_tick = time.monotonic()  # the event loop's last sign of progress (watch())

    def status_now(self, service: str) -> int | None:
        """The service's status as another thread should report it: NOT_SERVING while the event
        loop has been stalled for stall_s; None for an unknown service."""
        status = self.statuses.get(service)
        if status is not None and time.monotonic() - self.last_tick > self.stall_s:
            return NOT_SERVING
        return status

    async def _set(self, service: str, status: int) -> None:
        self.statuses[service] = status
        await self.servicer.set(service, status)

    async def start(self) -> None:
        await self._set(LIVENESS, SERVING)
        await self._set("", SERVING)
        await self.refresh()

    async def shutdown(self) -> None:
        """Every service NOT_SERVING: Envoy stops sending new streams before the server stops."""
        self.statuses = dict.fromkeys(self.statuses, NOT_SERVING)
        await self.servicer.enter_graceful_shutdown()

    def _synced(self) -> bool:
        """Endpoints known and each one's KV-event state replayed (or given up after the
        subscriber's sync timeout), so the first picks see the engines' caches. Latched: an
        engine joining later must not take a serving EPP out of rotation."""
        if self._ready:
            return True
        ds = self.datastore
        return ds.synced and all(s.kv_synced for s in ds.all())

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    async def refresh(self) -> None:
        ready = self._synced()
        if ready != self._ready:
            self._ready = ready
            status = SERVING if ready else NOT_SERVING
            await self._set(READINESS, status)
            await self._set(GIE_READINESS, status)
            await self._set(EXT_PROC, status)

    async def watch(self, interval: float = TICK_S) -> None:
        while True:
            self.last_tick = time.monotonic()
            await self.refresh()
            await asyncio.sleep(interval)


class _ThreadedServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, health: EppHealth) -> None:
        self.health = health

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.health.status_now(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        last: int | None = -1
        while context.is_active():
            status = self.health.status_now(request.service)
            if status != last:
                unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                yield health_pb2.HealthCheckResponse(status=unknown if status is None else status)
                last = status
            time.sleep(TICK_S)


class ThreadedHealthServer:
    """grpc.health.v1 on its own port, served by grpcio's threads (see the module docstring).
    Bound at construction (port 0 picks a free one)."""

    # Check is a dict read; Watch holds a worker for its stream's life (kubelet and Envoy use Check)
    WORKERS = 8

    def __init__(self, health: EppHealth, host: str, port: int) -> None:
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=self.WORKERS, thread_name_prefix="grpc-health"),
            options=[("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=4 * self.WORKERS,  # more Watches than that: RESOURCE_EXHAUSTED
        )
        health_pb2_grpc.add_HealthServicer_to_server(_ThreadedServicer(health), self._server)
        self.port: int = self._server.add_insecure_port(f"{host}:{port}")

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=0)

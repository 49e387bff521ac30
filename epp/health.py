"""gRPC health on its own port: liveness always; readiness and ext_proc once endpoints are known
and their KV-event state is replayed (each engine's replay bounded by the subscriber's timeout)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from kvgate.epp.datastore import Datastore

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppHealth:
    def __init__(self, datastore: Datastore) -> None:
        self.servicer = HealthServicer()
        self.datastore = datastore
        self._ready: bool | None = None
        # the same statuses for a health service on another gRPC server (kvgate.epp.grpclib_server)
        self.statuses: dict[str, int] = {}

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
            await self._set(EXT_PROC, status)

    async def watch(self, interval: float = 0.2) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

"""gRPC health on its own port: liveness always; readiness and ext_proc once endpoints are synced."""

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

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, SERVING)
        await self.servicer.set("", SERVING)
        await self.refresh()

    async def refresh(self) -> None:
        ready = self.datastore.synced
        if ready != self._ready:
            self._ready = ready
            status = SERVING if ready else NOT_SERVING
            await self.servicer.set(READINESS, status)
            await self.servicer.set(EXT_PROC, status)

    async def watch(self, interval: float = 0.2) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

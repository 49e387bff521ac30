"""A Kubernetes API server on loopback as a pod sees it: kmock's emulator behind TLS, accepting
only the bearer tokens it was told are valid, plus the service-account folder (token, ca.crt,
namespace) a pod gets mounted. Used where in-cluster code (the EPP's discovery) must run as it
does in a pod, not through an explicit --api-server URL.
"""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.test_utils
import httpx
import kmock

from kvgate.api.tls import self_signed_cert


class TokenCheckingEmulator(kmock.KubernetesEmulator):
    """Answers 401, as the API server does, to a request without a currently valid token."""

    valid_tokens: set[str]
    refused: int

    async def _handle(self, request: Any) -> Any:
        auth = request.headers.get("Authorization") or request.headers.get("authorization") or ""
        if auth.removeprefix("Bearer ") not in self.valid_tokens:
            self.refused += 1
            raise kmock.KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
        return await super()._handle(request)


@dataclass
class ApiServer:
    emulator: TokenCheckingEmulator
    host: str
    port: int
    sa_dir: Path
    seen_tokens: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What the kubelet puts in every pod's environment for the in-cluster client."""
        return {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT": str(self.port)}

    def client(self) -> httpx.AsyncClient:
        """An admin client (the test's own, not the pod's): always the current token."""
        token = sorted(self.emulator.valid_tokens)[0]
        return httpx.AsyncClient(
            base_url=f"https://{self.host}:{self.port}",
            verify=ssl.create_default_context(cafile=str(self.sa_dir / "ca.crt")),
            headers={"Authorization": f"Bearer {token}"},
        )

    def rotate(self, token: str, revoke_old: bool = True) -> None:
        """What the kubelet does before a projected token expires: a new file, same path."""
        if revoke_old:
            self.emulator.valid_tokens.clear()
        self.emulator.valid_tokens.add(token)
        (self.sa_dir / "token").write_text(token)


def _tls_server_class(context: ssl.SSLContext) -> type[aiohttp.test_utils.RawTestServer]:
    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
            await super().start_server(loop=loop, ssl=context, **kwargs)

    return TLSServer


# What the EPP and the operator's children need served, as (group/version/plural, kind).
RESOURCES = (
    ("inference.networking.k8s.io/v1/inferencepools", "InferencePool"),
    ("inference.networking.x-k8s.io/v1alpha2/inferenceobjectives", "InferenceObjective"),
    ("v1/pods", "Pod"),
)


@asynccontextmanager
async def api_server(
    namespace: str = "default",
    token: str = "token-1",
    hostnames: tuple[str, ...] = ("localhost",),
    port: int | None = None,
) -> AsyncIterator[ApiServer]:
    """``hostnames`` go into the serving certificate (kopf's in-cluster login dials
    kubernetes.default.svc, not an IP); ``port`` None picks a free one."""
    cert, key = self_signed_cert(hostnames)
    with tempfile.TemporaryDirectory(prefix="kvgate-sa-") as tmp:
        sa_dir = Path(tmp)
        (sa_dir / "ca.crt").write_bytes(cert)
        (sa_dir / "tls.key").write_bytes(key)
        (sa_dir / "namespace").write_text(namespace)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(sa_dir / "ca.crt", sa_dir / "tls.key")
        (sa_dir / "tls.key").unlink()  # a pod's service-account folder holds no key
        emulator = TokenCheckingEmulator()
        emulator.valid_tokens, emulator.refused = set(), 0
        for resource, kind in RESOURCES:
            emulator.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
        async with (
            emulator,
            kmock.Server(emulator, port=port, server_cls=_tls_server_class(context)) as server,
        ):
            api = ApiServer(emulator, "127.0.0.1", int(server.port), sa_dir)
            api.rotate(token)
            yield api

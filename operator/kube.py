"""A small async Kubernetes REST client for the operator's own reads and writes.

kopf watches and calls handlers; children are written here, with the same credentials kopf
logged in with (a `kopf.ConnectionInfo`), so one login serves both. Writes are JSON merge
patches (`application/merge-patch+json`): lists are replaced whole, which is what "make the
child look like this" means, and fields other controllers add (KEDA's labels and finalizers,
defaulted fields) are left alone.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvgate.operator.resources import Resource


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Credentials:
    """The parts of a kopf.ConnectionInfo this client needs."""

    server: str
    token: str | None = None
    scheme: str | None = None
    ca_path: str | None = None
    ca_data: bytes | str | None = None
    insecure: bool = False
    certificate_path: str | None = None
    certificate_data: bytes | str | None = None
    private_key_path: str | None = None
    private_key_data: bytes | str | None = None
    username: str | None = None
    password: str | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> Credentials:
        return cls(
            server=info.server,
            token=getattr(info, "token", None),
            scheme=getattr(info, "scheme", None),
            ca_path=_str_path(getattr(info, "ca_path", None)),
            ca_data=getattr(info, "ca_data", None),
            insecure=bool(getattr(info, "insecure", False)),
            certificate_path=_str_path(getattr(info, "certificate_path", None)),
            certificate_data=getattr(info, "certificate_data", None),
            private_key_path=_str_path(getattr(info, "private_key_path", None)),
            private_key_data=getattr(info, "private_key_data", None),
            username=getattr(info, "username", None),
            password=getattr(info, "password", None),
        )


def _str_path(path: Any) -> str | None:
    return None if path is None else os.fsdecode(path)


def _pem(data: bytes | str) -> bytes:
    # kubeconfig carries base64 PEM; kopf may pass either form, as str or bytes.
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _ssl_context(creds: Credentials) -> ssl.SSLContext | bool:
    if not creds.server.startswith("https"):
        return False
    if creds.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif creds.ca_path or creds.ca_data:
        ctx = ssl.create_default_context(cafile=creds.ca_path)
        if creds.ca_data:
            ctx.load_verify_locations(cadata=_pem(creds.ca_data).decode())
    else:
        ctx = ssl.create_default_context()
    cert, key = creds.certificate_path, creds.private_key_path
    if creds.certificate_data and creds.private_key_data:
        # ssl wants files; the temporary ones live only as long as loading takes.
        with tempfile.NamedTemporaryFile() as c, tempfile.NamedTemporaryFile() as k:
            c.write(_pem(creds.certificate_data))
            k.write(_pem(creds.private_key_data))
            c.flush()
            k.flush()
            ctx.load_cert_chain(c.name, k.name)
    elif cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class KubeClient:
    def __init__(self, creds: Credentials, timeout_s: float = 30.0) -> None:
        self._creds = creds
        headers = {"Accept": "application/json", "User-Agent": "kvgate-operator"}
        auth = None
        if creds.token:
            headers["Authorization"] = f"{creds.scheme or 'Bearer'} {creds.token}"
        elif creds.username and creds.password:
            auth = aiohttp.BasicAuth(creds.username, creds.password)
        self._session = aiohttp.ClientSession(
            base_url=creds.server.rstrip("/"),
            headers=headers,
            auth=auth,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(ssl=_ssl_context(creds)),
        )

    async def close(self) -> None:
        await self._session.close()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        async with self._session.request(method, path, **kwargs) as resp:
            text = await resp.text()
            if resp.status >= 400:
                reason, message = resp.reason or "", text[:500]
                try:
                    body = await resp.json(content_type=None)
                    reason = body.get("reason") or reason
                    message = body.get("message") or message
                except ValueError:
                    pass
                raise ApiError(resp.status, str(reason), str(message))
            return await resp.json(content_type=None) if text else None

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", res.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, res: Resource, namespace: str | None, label_selector: str | None = None
    ) -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else None
        body = await self._request("GET", res.path(namespace), params=params)
        return list((body or {}).get("items") or [])

    async def create(self, res: Resource, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", res.path(namespace), json=body)

    async def patch(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
        content_type: str = "application/merge-patch+json",
    ) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            res.path(namespace, name, subresource),
            data=json.dumps(body),
            headers={"Content-Type": content_type},
        )

    async def delete(self, res: Resource, namespace: str | None, name: str) -> bool:
        """Deletes in the background (children go via garbage collection); False if absent."""
        try:
            await self._request(
                "DELETE",
                res.path(namespace, name),
                json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def serves(self, res: Resource) -> bool:
        """Whether the API server serves this resource (e.g. KEDA's or Gateway API's CRDs)."""
        path = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
        try:
            body = await self._request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in (body or {}).get("resources", []))

"""Tenants: who may use the pool, and who a request belongs to.

A tenants file is YAML, a list of ``{name, key, weight, priority}``. A client presents its key
as OpenAI clients do (``Authorization: Bearer <key>``, the `openai` SDK's ``api_key``); the
EPP checks it on the request's headers, before the body is read, and the tenant it names
becomes the request's fairness id. A client's own ``x-gateway-inference-fairness-id`` is then
never believed. Without a tenants file every request belongs to one anonymous tenant (or to the
fairness id its header names, as GIE does), and no key is asked for.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
MAX_FILE_BYTES = 1 << 20
# A tenant name travels in a header and labels metrics: short and plain.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MIN_KEY_CHARS = 16


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message says where and why."""


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    key: str = Field(repr=False)
    weight: float = Field(default=1.0, gt=0, le=1e6)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("key")
    @classmethod
    def _long_key(cls, value: str) -> str:
        if len(value) < MIN_KEY_CHARS or len(value) > 4096 or any(c.isspace() for c in value):
            raise ValueError(f"must be {MIN_KEY_CHARS}-4096 characters without spaces")
        return value


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int = 0


ANONYMOUS = Tenant(DEFAULT_TENANT)


def valid_fairness_id(value: str | None) -> str | None:
    """A client's ``x-gateway-inference-fairness-id`` if it could be a tenant's name (short,
    plain: it labels metrics and travels on to the engine), else None."""
    if value and _NAME.fullmatch(value):
        return value
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantRegistry:
    """Keys → tenants. Keys are kept only as SHA-256 digests and compared in constant time."""

    def __init__(self, specs: list[TenantSpec]) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        for spec in specs:
            if spec.name in self.tenants:
                raise TenantsFileError(f"tenant {spec.name!r} is listed twice")
            digest = _digest(spec.key)
            if digest in self._by_digest:
                raise TenantsFileError(f"tenant {spec.name!r} reuses another tenant's key")
            tenant = Tenant(spec.name, spec.weight, spec.priority)
            self._by_digest[digest] = tenant
            self.tenants[spec.name] = tenant

    def __len__(self) -> int:
        return len(self.tenants)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key the ``Authorization`` header carries, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = _digest(key.strip())
        # Every stored digest is compared, so the time taken says nothing about which matched.
        found: Tenant | None = None
        for stored, tenant in self._by_digest.items():
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def weight(self, name: str) -> float:
        tenant = self.tenants.get(name)
        return tenant.weight if tenant is not None else 1.0

    def replace_with(self, other: TenantRegistry) -> None:
        """Take another registry's tenants and keys (a reloaded file). One assignment each, on
        the event loop's thread: a request is checked against the old keys or the new ones."""
        self._by_digest, self.tenants = other._by_digest, other.tenants


def parse_tenants(raw: Any, source: str = "tenants file") -> TenantRegistry:
    if isinstance(raw, dict) and "tenants" in raw:
        raw = raw["tenants"]
    if not isinstance(raw, list) or not raw:
        raise TenantsFileError(f"{source}: expected a non-empty YAML list of {{name, key, weight, priority}}")
    specs = []
    for i, item in enumerate(raw):
        try:
            specs.append(TenantSpec.model_validate(item))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'entry'}: {err['msg']}" for err in exc.errors()
            )
            raise TenantsFileError(f"{source}: tenant #{i + 1}: {problems}") from None
    try:
        return TenantRegistry(specs)
    except TenantsFileError as exc:
        raise TenantsFileError(f"{source}: {exc}") from None


def load_tenants(path: str | Path) -> TenantRegistry:
    """Read and check a tenants file; every problem is a TenantsFileError with a clear message."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise TenantsFileError(f"{p}: {size} bytes; a tenants file is at most {MAX_FILE_BYTES}")
        text = p.read_text()
    except OSError as exc:
        raise TenantsFileError(f"cannot read tenants file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TenantsFileError(f"{p}: not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # one line: YAML's own message spans several, quoting the file (a key, maybe)
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise TenantsFileError(f"{p}: not valid YAML{where}: {problem}") from None
    return parse_tenants(raw, str(p))


RELOAD_INTERVAL_S = 2.0


class TenantsReloader:
    """Keeps a registry in step with its file, so keys rotate without a restart: the file is
    looked at every ``interval`` seconds and read again when its size, mtime or inode changed
    (a Kubernetes Secret volume swaps a symlink; the kubelet itself syncs it within its own
    period, about a minute). A file that no longer loads is reported and the keys in force
    stay: a bad edit neither opens the pool nor locks every tenant out."""

    def __init__(
        self,
        path: str | Path,
        registry: TenantRegistry,
        interval: float = RELOAD_INTERVAL_S,
        on_reload: Callable[[TenantRegistry], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.registry = registry
        self.interval = interval
        self.on_reload = on_reload
        self._seen = self._stamp()
        self.reloads = 0
        self.failures = 0

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    def check(self) -> bool:
        """Reload if the file changed; True when new keys are in force."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            fresh = load_tenants(self.path)
        except TenantsFileError as exc:
            self.failures += 1
            log.error("tenants file not reloaded, the keys in force stay: %s", exc)
            return False
        self.registry.replace_with(fresh)
        self.reloads += 1
        log.info("tenants file reloaded", extra={"tenants": len(fresh)})
        if self.on_reload is not None:
            self.on_reload(self.registry)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()


def first_key(path: str | Path) -> str:
    """The first tenant's key in a tenants file (checked): what a local stack's own readiness
    probe presents."""
    load_tenants(path)
    raw = yaml.safe_load(Path(path).read_text())
    if isinstance(raw, dict):
        raw = raw["tenants"]
    return str(raw[0]["key"])

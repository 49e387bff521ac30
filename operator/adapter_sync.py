"""Makes every ready engine pod serve exactly the ModelDeployment's LoRA adapters, at run time.

Each pass (create, update, child events, the resync timer) asks each ready engine pod for its
`GET /v1/models` (the engine lists an adapter only once it can serve it), then, per pod:
loads each adapter of the spec it lacks (`POST /v1/load_lora_adapter`, vLLM's body), reloads
one whose folder changed (`load_inplace`), and unloads adapters the operator loaded before
(listed in the previous status.adapters) that the spec no longer has. Adapters someone else
loaded are left alone. Every call is idempotent against what the pod reports, so a missed or
failed pass is repaired by the next one. The engines' pod template never changes for this
(its LoRA parts, flags, volumes, sidecar and readiness gate, are built in children/adapters.py).

With LoRA on, the pod template carries a readiness gate (kvgate.dev/lora-adapters): a pod whose
engine is up is loaded here, and its gate set once it has every adapter, or once
lora.loadTimeoutSeconds have passed (a broken adapter must not keep pods out of service).

The API key: the engines' `KVGATE_API_KEY` env entry (a literal, or a Secret key) or an
`--api-key` in spec.engine.args, sent as a bearer token like any client.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.conditions import Cond, now_rfc3339
from kvgate.operator.kube import ApiError, KubeClient
from kvgate.operator.resources import PODS, SECRETS

log = logging.getLogger("kvgate.operator.adapters")  # its name before the module was adapter_sync
LIST_TIMEOUT_S = 5.0
# A load reads the adapter folder (a real engine parses and checks its tensors): allow for disks.
LOAD_TIMEOUT_S = 120.0
MAX_MESSAGE = 400


@dataclass(frozen=True)
class EnginePod:
    name: str
    url: str  # http://ip:port
    gated: bool = False  # the adapters readiness gate is already True
    up_since: str | None = None  # when its containers turned ready (RFC 3339)
    conditions: tuple[dict[str, Any], ...] = ()


@dataclass
class PodResult:
    """What one pod serves after the pass, and what it refused."""

    loaded: dict[str, str] = field(default_factory=dict)  # adapter name -> its root (path)
    errors: dict[str, str] = field(default_factory=dict)  # adapter name -> engine's message
    unreachable: str | None = None


@dataclass
class AdapterReport:
    entries: list[dict[str, Any]]  # status.adapters
    condition: Cond | None


def ready_engine_pods(pods: list[dict[str, Any]], selector: dict[str, str], port: int) -> list[EnginePod]:
    """The pods of the engine selector whose engine is up (its containers ready: the pod itself
    waits on our readiness gate), with an IP and not terminating."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = pod.get("status") or {}
        if any(labels.get(k) != v for k, v in selector.items()) or meta.get("deletionTimestamp"):
            continue
        conds = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
        up = next(
            (conds[t] for t in ("ContainersReady", "Ready") if conds.get(t, {}).get("status") == "True"), None
        )
        if up is not None and status.get("podIP"):
            out.append(
                EnginePod(
                    meta["name"],
                    f"http://{url_host(status['podIP'])}:{port}",
                    gated=conds.get(ch.ADAPTERS_GATE, {}).get("status") == "True",
                    up_since=up.get("lastTransitionTime"),
                    conditions=tuple(conds.values()),
                )
            )
    return sorted(out, key=lambda p: p.name)


def adapters_gate_pending(pod: dict[str, Any]) -> bool:
    """Whether a pod has our readiness gate, not yet set, and its containers are ready."""
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    if not any(g.get("conditionType") == ch.ADAPTERS_GATE for g in gates if isinstance(g, dict)):
        return False
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("ContainersReady") == "True" and conds.get(ch.ADAPTERS_GATE) != "True"


def _age_s(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.datetime.now(datetime.UTC) - when).total_seconds()


def gate_decision(pod: EnginePod, result: PodResult, want: dict[str, str], timeout_s: int) -> Cond | None:
    """The readiness-gate condition to set on a pod now, or None (already set, or keep waiting)."""
    if pod.gated:
        return None
    if (
        result.unreachable is None
        and not result.errors
        and all(result.loaded.get(n) == p for n, p in want.items())
    ):
        return Cond(ch.ADAPTERS_GATE, "True", "AdaptersLoaded", f"{len(want)} LoRA adapter(s) loaded.")
    age = _age_s(pod.up_since)
    if age is not None and age >= timeout_s:
        missing = sorted(n for n, p in want.items() if result.loaded.get(n) != p)
        msg = f"Serving after {timeout_s}s (lora.loadTimeoutSeconds) without: {', '.join(missing) or 'none'}."
        return Cond(ch.ADAPTERS_GATE, "True", "LoadTimeout", msg)
    return None


async def open_gate(client: KubeClient, namespace: str, pod: EnginePod, cond: Cond) -> None:
    """Sets the pod's readiness gate condition. A strategic merge patch merges conditions by
    type on a real API server; the whole list is sent so a merge patch keeps the others too."""
    entry = {
        "type": cond.type,
        "status": cond.status,
        "reason": cond.reason,
        "message": cond.message,
        "lastTransitionTime": now_rfc3339(),
    }
    conditions = [c for c in pod.conditions if c.get("type") != cond.type] + [entry]
    try:
        await client.patch(
            PODS,
            namespace,
            pod.name,
            {"status": {"conditions": conditions}},
            "status",
            content_type="application/strategic-merge-patch+json",
        )
        log.info("pod %s/%s ready for traffic: %s", namespace, pod.name, cond.message)
    except ApiError as exc:  # gone meanwhile, or not ours to patch: the next pass sees
        log.warning("could not set %s on pod %s/%s: %s", cond.type, namespace, pod.name, exc)


def url_host(ip: str) -> str:
    """An IP as the host part of a URL (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip else ip


async def engine_api_key(client: KubeClient, namespace: str, spec: ModelDeploymentSpec) -> str | None:
    """The key the engines require, as the pod gets it: --api-key in args, else KVGATE_API_KEY."""
    args = list(spec.engine.args)
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    for env in spec.engine.env:
        if env.name != ch.API_KEY_ENV:
            continue
        if env.value is not None:
            return env.value
        ref = (env.value_from or {}).get("secretKeyRef") or {}
        if ref.get("name") and ref.get("key"):
            secret = await client.get(SECRETS, namespace, ref["name"])
            data = ((secret or {}).get("data") or {}).get(ref["key"])
            if data is None:
                raise LookupError(f"Secret {ref['name']} has no key {ref['key']!r} (the engines' API key)")
            return base64.b64decode(data).decode()
    return None


def _error_message(status: int, text: str) -> str:
    """The engine's OpenAI-shaped error message, else the body's start."""
    try:
        body = json.loads(text)
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else None
        message = message or body.get("detail") or body.get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {str(message or text.strip() or 'no body')[:MAX_MESSAGE]}"


class AdapterSync:
    def __init__(self, session: aiohttp.ClientSession, api_key: str | None) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _models(self, pod: EnginePod) -> dict[str, str]:
        async with self._session.get(
            f"{pod.url}/v1/models", headers=self._headers, timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT_S)
        ) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(_error_message(resp.status, text))
            body = await resp.json(content_type=None)
        return {
            m["id"]: str(m.get("root") or "")
            for m in body.get("data") or []
            if isinstance(m, dict) and m.get("parent")
        }

    async def _post(self, pod: EnginePod, path: str, body: dict[str, Any]) -> str | None:
        """None on success, else the engine's error."""
        try:
            async with self._session.post(
                f"{pod.url}{path}",
                json=body,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S),
            ) as resp:
                text = await resp.text()
                return None if resp.status == 200 else _error_message(resp.status, text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE]

    async def sync_pod(self, pod: EnginePod, want: dict[str, str], drop: set[str]) -> PodResult:
        try:
            have = await self._models(pod)
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            return PodResult(unreachable=f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE])
        result = PodResult(loaded=dict(have))
        for name in sorted(drop & set(have)):
            error = await self._post(pod, "/v1/unload_lora_adapter", {"lora_name": name})
            if error is None:
                result.loaded.pop(name, None)
                log.info("unloaded adapter %s from %s", name, pod.name)
            else:
                result.errors[name] = error
        for name, path in sorted(want.items()):
            if have.get(name) == path:
                continue
            body: dict[str, Any] = {"lora_name": name, "lora_path": path}
            if name in have:  # same name, another folder: replace it in place
                body["load_inplace"] = True
            error = await self._post(pod, "/v1/load_lora_adapter", body)
            if error is None:
                result.loaded[name] = path
                log.info("loaded adapter %s (%s) on %s", name, path, pod.name)
            else:
                result.errors[name] = error
        return result

    async def sync(self, pods: list[EnginePod], want: dict[str, str], drop: set[str]) -> dict[str, PodResult]:
        results = await asyncio.gather(*(self.sync_pod(p, want, drop) for p in pods))
        return {p.name: r for p, r in zip(pods, results, strict=True)}


def report(
    spec: ModelDeploymentSpec, paths: dict[str, str], drop: set[str], results: dict[str, PodResult]
) -> AdapterReport:
    """status.adapters and the Adapters condition from one pass's results."""
    entries: list[dict[str, Any]] = []
    failures: list[str] = []
    pending: list[str] = []
    for adapter in spec.adapters:
        path = paths[adapter.name]
        on = sorted(pod for pod, r in results.items() if r.loaded.get(adapter.name) == path)
        refused = {pod: r.errors[adapter.name] for pod, r in results.items() if adapter.name in r.errors}
        entry: dict[str, Any] = {"name": adapter.name, "source": adapter.source, "pods": on}
        if refused:
            entry["state"] = "Failed"
            entry["message"] = "; ".join(f"{pod}: {msg}" for pod, msg in sorted(refused.items()))[:4096]
            failures.append(f"{adapter.name} on {entry['message']}")
        elif len(on) == len(results) and results:
            entry["state"] = "Loaded"
        else:
            entry["state"] = "Loading"
            pending.append(adapter.name)
        entries.append(entry)
    for name in sorted(drop):
        still = sorted(pod for pod, r in results.items() if name in r.loaded)
        if still or any(r.unreachable for r in results.values()):
            # Kept in status until no pod has it, so the next pass still unloads it.
            entry = {"name": name, "state": "Unloading", "pods": still}
            refused = {pod: r.errors[name] for pod, r in results.items() if name in r.errors}
            if refused:
                entry["message"] = "; ".join(f"{pod}: {msg}" for pod, msg in sorted(refused.items()))[:4096]
            entries.append(entry)
    unreachable = {pod: r.unreachable for pod, r in results.items() if r.unreachable is not None}
    if not spec.adapters and not drop:
        cond = None
    elif failures:
        cond = Cond("Adapters", "False", "LoadFailed", "; ".join(failures)[:4000])
    elif unreachable:
        msg = "; ".join(f"{pod}: {why}" for pod, why in sorted(unreachable.items()))
        cond = Cond("Adapters", "False", "EngineUnreachable", f"Cannot list adapters on {msg}"[:4000])
    elif not results:
        cond = Cond("Adapters", "Unknown", "NoReadyEngines", "No ready engine pod to load adapters into.")
    elif pending:
        cond = Cond("Adapters", "False", "Loading", f"Not yet on every ready engine: {', '.join(pending)}.")
    else:
        n = len(spec.adapters)
        cond = Cond(
            "Adapters", "True", "Loaded", f"{n} adapter(s) loaded on all {len(results)} ready engine(s)."
        )
    return AdapterReport(entries, cond)


async def sync_adapters(
    client: KubeClient,
    namespace: str,
    name: str,
    spec: ModelDeploymentSpec,
    previous: list[dict[str, Any]] | None,
) -> AdapterReport | None:
    """One pass over the ModelDeployment's ready engine pods; None when there is nothing to do."""
    managed_before = {str(e["name"]) for e in previous or [] if isinstance(e, dict) and e.get("name")}
    paths = {a.name: ch.adapter_path(spec, a) for a in spec.adapters}
    drop = {n for n in managed_before if n not in paths}
    if not spec.adapters and not drop and not spec.lora_enabled():
        return None
    try:
        key = await engine_api_key(client, namespace, spec)
    except LookupError as exc:
        return AdapterReport(
            [dict(e) for e in previous or []], Cond("Adapters", "False", "APIKeyMissing", str(exc))
        )
    selector = ch.engine_selector(name)
    label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
    pods = ready_engine_pods(await client.list(PODS, namespace, label_selector), selector, spec.engine.port)
    async with aiohttp.ClientSession() as session:
        results = await AdapterSync(session, key).sync(pods, paths, drop)
    if spec.lora_enabled():
        timeout = spec.lora_settings().load_timeout_seconds
        for pod in pods:
            cond = gate_decision(pod, results[pod.name], paths, timeout)
            if cond is not None:
                await open_gate(client, namespace, pod, cond)
    return report(spec, paths, drop, results)

"""Makes the cluster match a ModelDeployment (or an EPP-managed InferencePool), and reports.

One pass: validate the spec (an invalid one creates nothing), learn what the cluster serves
(KEDA, Gateway API), create or patch each child only where it differs from what we want,
delete optional children no longer wanted, then read the children back into status
conditions (status.py, pure). Every pass is idempotent, so the same code serves create, update, resume and the
periodic drift check.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvgate.api.k8s.crds import (
    EndpointPickerRef,
    InferencePool,
    ModelDeploymentSpec,
    PoolSignals,
    Port,
    RoutingSpec,
    TenantsSpec,
)
from kvgate.operator import children as ch
from kvgate.operator.adapter_sync import sync_adapters
from kvgate.operator.children.engine_key import (
    ENGINE_KEY_SECRET_KEY,
    engine_key_secret_name,
    engine_key_wanted,
    with_engine_key,
)
from kvgate.operator.conditions import Cond, merge_conditions, now_rfc3339
from kvgate.operator.config import OperatorConfig
from kvgate.operator.disaggregation_pass import (
    disaggregated_status,
    ensure_kv_transfer_secret,
    existing_roles,
    name_problem,
)
from kvgate.operator.kube import ApiError, KubeClient
from kvgate.operator.own_secrets import ensure_random_secret
from kvgate.operator.resources import (
    BY_KIND,
    DEPLOYMENTS,
    HTTP_ROUTES,
    INFERENCE_POOLS,
    SCALED_OBJECTS,
    SECRETS,
    resource_of,
)
from kvgate.operator.signals import SignalReader
from kvgate.operator.status import Event, degraded_by, model_deployment_status, problems, tenants_problem

APPLIED_ANNOTATION = "kvgate.dev/applied"
log = logging.getLogger("kvgate.operator")


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Patching helpers (pure)
# ---------------------------------------------------------------------------------------------
#
# A JSON merge patch plus the applied-annotation 3-way diff, not server-side apply: the tests'
# API server (kmock 0.8's emulator) treats every PATCH as a merge patch whatever its
# Content-Type, answers 404 instead of creating, and keeps no managedFields, so an apply
# patch would pass there with merge semantics (no pruning of fields we stopped applying, no
# conflicts) that a real API server does not have.


def is_subset(want: Any, have: Any) -> bool:
    """Whether `have` already carries everything in `want` (extra fields in `have` are fine)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(a, b) for a, b in zip(want, have, strict=True))
        )
    if isinstance(want, bool) or isinstance(have, bool):
        return want == have
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)):
        return str(want) == str(have)  # quantities and int-or-string ports come back either way
    return bool(want == have)


# Fields we stop setting in order to hand them to another controller, not to clear them:
# nulling spec.replicas would make the API server default it to 1 and scale the engines down
# before the autoscaler acts.
HANDED_OVER: frozenset[tuple[str, ...]] = frozenset({("spec", "replicas")})


def removals(previous: Any, current: Any, path: tuple[str, ...] = ()) -> Any:
    """Merge-patch nulls for dict keys we set before and no longer want (a 3-way apply)."""
    if not isinstance(previous, dict) or not isinstance(current, dict):
        return None
    out: dict[str, Any] = {}
    for key, old in previous.items():
        if key not in current:
            if (*path, key) not in HANDED_OVER:
                out[key] = None
        else:
            nested = removals(old, current[key], (*path, key))
            if nested:
                out[key] = nested
    return out


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        elif key not in out:
            out[key] = value
    return out


def _applied_body(manifest: dict[str, Any]) -> dict[str, Any]:
    # What we record as applied: everything but identity (metadata.name/namespace/owner).
    meta = manifest.get("metadata", {})
    body = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
    body["metadata"] = {k: v for k, v in meta.items() if k in ("labels", "annotations")}
    return body


def with_applied_annotation(manifest: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(manifest))
    record = json.dumps(_applied_body(manifest), sort_keys=True, separators=(",", ":"))
    out["metadata"].setdefault("annotations", {})[APPLIED_ANNOTATION] = record
    return out


def patch_for(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The merge patch turning `live` into `desired`, nulling what we applied before but dropped."""
    patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    previous_raw = (live.get("metadata", {}).get("annotations") or {}).get(APPLIED_ANNOTATION)
    if previous_raw:
        try:
            previous = json.loads(previous_raw)
        except ValueError:
            previous = None
        nulls = removals(previous, _applied_body(desired)) if previous else None
        if nulls:
            patch = _deep_merge(patch, nulls)
    return patch


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


# ---------------------------------------------------------------------------------------------
# Reconciler
# ---------------------------------------------------------------------------------------------


class SpecError(Exception):
    pass


class OwnerGone(Exception):
    """The owner was deleted (or replaced) while it was being reconciled."""


def parse_spec(name: str, raw_spec: dict[str, Any] | None) -> ModelDeploymentSpec:
    if len(name) > ch.MAX_MD_NAME:
        raise SpecError(f"metadata.name: at most {ch.MAX_MD_NAME} characters (the EPP Service adds '-epp')")
    try:
        spec = ModelDeploymentSpec.model_validate(raw_spec or {})
    except ValidationError as exc:
        raise SpecError(problems(exc, "spec")) from None
    problem = name_problem(name, spec)
    if problem:
        raise SpecError(problem)
    return spec


class Reconciler:
    def __init__(
        self,
        client: KubeClient,
        config: OperatorConfig,
        signals: SignalReader | None = None,
        capability_ttl_s: float = 10.0,
    ) -> None:
        self.client = client
        self.config = config
        self.signals = signals
        self._caps: ch.Capabilities | None = None
        self._caps_at = 0.0
        self._caps_ttl = capability_ttl_s

    async def capabilities(self) -> ch.Capabilities:
        if self._caps is None or time.monotonic() - self._caps_at > self._caps_ttl:
            self._caps = ch.Capabilities(
                keda=await self.client.serves(SCALED_OBJECTS),
                gateway_api=await self.client.serves(HTTP_ROUTES),
            )
            self._caps_at = time.monotonic()
        return self._caps

    async def apply(
        self, manifest: dict[str, Any], live: dict[str, Any] | None
    ) -> tuple[dict[str, Any], str]:
        """Create or patch one child given its live state; returns the result and what was done."""
        res = resource_of(manifest)
        ns, name = manifest["metadata"].get("namespace"), manifest["metadata"]["name"]
        desired = with_applied_annotation(manifest)
        if live is None:
            return await self.client.create(res, ns, desired), "created"
        if is_subset(desired, live):
            return live, "unchanged"
        return await self.client.patch(res, ns, name, patch_for(desired, live)), "patched"

    async def apply_all(self, manifests: list[dict[str, Any]], owner_uid: str) -> dict[str, dict[str, Any]]:
        """Applies every child, or none: an object of a child's name that someone else owns stops
        the whole set before anything is written (it is never taken over)."""
        lives = [
            await self.client.get(resource_of(m), m["metadata"].get("namespace"), m["metadata"]["name"])
            for m in manifests
        ]
        foreign = [
            f"{m['kind']} {m['metadata']['namespace']}/{m['metadata']['name']}"
            for m, live in zip(manifests, lives, strict=True)
            if live is not None and not controlled_by(live, owner_uid)
        ]
        if foreign:
            raise ApiError(409, "Conflict", f"{', '.join(foreign)} exist(s) and is not managed by kvgate")
        if any(live is None for live in lives) and not await self._owner_alive(manifests[0], owner_uid):
            # The owner went away while we worked (or this pass began from a stale event): a
            # child created now would only wait for the garbage collector.
            raise OwnerGone(owner_uid)
        out: dict[str, dict[str, Any]] = {}
        for manifest, live in zip(manifests, lives, strict=True):
            obj, action = await self.apply(manifest, live)
            meta = manifest["metadata"]
            if action != "unchanged":
                log.info("%s %s/%s %s", manifest["kind"], meta["namespace"], meta["name"], action)
            out[f"{manifest['kind']}/{meta['name']}"] = obj
        return out

    async def _owner_alive(self, child: dict[str, Any], owner_uid: str) -> bool:
        ref = child["metadata"]["ownerReferences"][0]
        owner = await self.client.get(resource_of(ref), child["metadata"]["namespace"], ref["name"])
        meta = (owner or {}).get("metadata") or {}
        return meta.get("uid") == owner_uid and not meta.get("deletionTimestamp")

    async def prune(
        self, namespace: str, name: str, keep: set[tuple[str, str]], owner_uid: str, caps: ch.Capabilities
    ) -> None:
        """Deletes optional children we own that `keep` (kind, name) no longer lists."""
        served = {"ScaledObject": caps.keda, "HTTPRoute": caps.gateway_api}
        for kind, suffix in ch.OPTIONAL_CHILDREN:
            child = name + suffix
            if (kind, child) in keep or not served.get(kind, True):
                continue
            res = BY_KIND[kind]
            live = await self.client.get(res, namespace, child)
            if live is not None and controlled_by(live, owner_uid):
                await self.client.delete(res, namespace, child)
                log.info("%s %s/%s deleted (no longer wanted)", kind, namespace, child)

    # -- ModelDeployment ---------------------------------------------------------------------

    async def reconcile_model_deployment(self, body: dict[str, Any]) -> Outcome:
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid", "")
        generation = meta.get("generation")
        old_status = body.get("status") or {}
        old_conditions = old_status.get("conditions")
        try:
            spec = parse_spec(name, body.get("spec"))
        except SpecError as exc:
            return _failure(
                old_conditions,
                generation,
                "InvalidSpec",
                str(exc),
                "Fix the spec; nothing was created or changed.",
            )

        owner = ch.model_deployment_owner(name, namespace, uid)
        # With tenants, the engines require a key only the picker sends (children/engine_key.py)
        own_engine_key = engine_key_wanted(spec)
        spec = with_engine_key(name, spec)
        caps = await self.capabilities()
        engine_live = await self.client.get(DEPLOYMENTS, namespace, name)
        roles = await existing_roles(self.client, namespace, name, spec)
        manifests = ch.model_deployment_children(
            name, owner, spec, self.config, caps, engine_exists=engine_live is not None, existing_roles=roles
        )
        try:
            # Before the engines that read it (spec.disaggregation); made once, never rewritten.
            await ensure_kv_transfer_secret(self.client, owner, spec, self.config)
            if own_engine_key:
                await ensure_random_secret(
                    self.client,
                    owner,
                    self.config,
                    engine_key_secret_name(name),
                    ENGINE_KEY_SECRET_KEY,
                    "engine-key",
                )
            live = await self.apply_all(manifests, uid)
            keep = {(m["kind"], m["metadata"]["name"]) for m in manifests}
            await self.prune(namespace, name, keep, uid, caps)
        except ApiError as exc:
            msg = f"applying children failed: {exc}"
            return _failure(old_conditions, generation, "ApplyFailed", msg, msg)

        if spec.disaggregation is not None:
            report = disaggregated_status(name, spec, caps, live, old_conditions)
        else:
            report = model_deployment_status(
                name,
                spec,
                caps,
                engine=live[f"Deployment/{name}"],
                epp=live[f"Deployment/{ch.epp_name(name)}"],
                pool=live[f"InferencePool/{name}"],
                old_conditions=old_conditions,
            )
        status: dict[str, Any] = {"observedGeneration": generation, **report.fields}
        conds = report.conditions
        events = list(report.events)
        if spec.tenants is not None:
            problem = await self._tenants_problem(namespace, spec.tenants)
            if problem is not None:
                conds, warned = degraded_by(conds, *problem, old_conditions)
                events += warned
        if self.signals is not None:
            status["signals"], metrics_cond, has_data = await self._signals(name, spec, report.query)
            status["autoscaler"]["hasData"] = has_data
            conds.append(metrics_cond)
        adapters_cond = await self._adapters(namespace, name, spec, old_status, status)
        if adapters_cond is not None:
            conds.append(adapters_cond)
        status["conditions"] = merge_conditions(old_conditions, conds, generation)
        return Outcome(_drop_none(status), events)

    async def _tenants_problem(self, namespace: str, tenants: TenantsSpec) -> tuple[str, str] | None:
        """Whether spec.tenants' Secret holds its key: the picker pods need it to start. Not
        watched: the resync (or any child's change) sees it created or fixed."""
        try:
            secret = await self.client.get(SECRETS, namespace, tenants.secret_name)
        except ApiError as exc:  # e.g. no `get` on Secrets: the pods will say, the pass goes on
            log.warning("cannot read Secret %s/%s (spec.tenants): %s", namespace, tenants.secret_name, exc)
            return None
        return tenants_problem(tenants, secret)

    async def _adapters(
        self,
        namespace: str,
        name: str,
        spec: ModelDeploymentSpec,
        old: dict[str, Any],
        status: dict[str, Any],
    ) -> Cond | None:
        """Loads/unloads LoRA adapters on the ready engine pods; fills status.adapters."""
        try:
            result = await sync_adapters(self.client, namespace, name, spec, old.get("adapters"))
        except Exception as exc:  # the API server or an engine misbehaving must not stop the pass
            log.warning("adapter sync for %s/%s failed: %s", namespace, name, exc)
            if old.get("adapters"):
                status["adapters"] = old["adapters"]
            return Cond("Adapters", "Unknown", "SyncFailed", f"{type(exc).__name__}: {exc}"[:1000])
        if result is None:
            if old.get("adapters"):
                status["adapters"] = []  # none wanted, none left on any engine
            return None
        status["adapters"] = result.entries
        return result.condition

    async def _signals(
        self, pool: str, spec: ModelDeploymentSpec, query: str | None
    ) -> tuple[dict[str, Any] | None, Cond, bool | None]:
        assert self.signals is not None
        try:
            sig = await self.signals.read(pool, spec.model.effective_served_name())
        except Exception as exc:
            return None, Cond("Metrics", "False", "PrometheusUnreachable", str(exc)[:500]), None
        signals = PoolSignals(
            queue_size=_fmt(sig.queue_size),
            kv_cache_utilization=_fmt(sig.kv_cache_utilization),
            saturation=_fmt(sig.saturation),
            observed_at=now_rfc3339(),
        ).wire()
        if query is None:
            cond = Cond("Metrics", "True", "SignalsRead", f"Pool signals read from {sig.source}.")
            return signals, cond, None
        check = await self.signals.check(query)
        if check.error:
            return signals, Cond("Metrics", "False", "PrometheusUnreachable", check.error[:500]), False
        if not check.has_data:
            scraped = "is the EPP scraped?"
            if spec.network_policy.enabled:
                scraped += " spec.networkPolicy.metricsFrom must select Prometheus' pods"
            msg = f"The autoscaler's query returns no data ({scraped}): {query}"
            return signals, Cond("Metrics", "False", "NoData", msg), False
        return signals, Cond("Metrics", "True", "QueryHasData", "The autoscaler's query returns data."), True

    # -- InferencePool with kvgate.dev/epp: managed -------------------------------------------

    async def reconcile_managed_pool(self, body: dict[str, Any]) -> list[Event]:
        """Deploys a kvgate EPP for a hand-made InferencePool; fills endpointPickerRef if absent."""
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid", "")
        try:
            pool = InferencePool.model_validate(body)
        except ValidationError as exc:
            return [Event("Warning", "InvalidPool", f"not a valid InferencePool: {problems(exc)}")]
        ref = pool.spec.endpoint_picker_ref
        epp = ref.name if ref else ch.epp_name(name)
        if len(epp) > 63:
            return [Event("Warning", "InvalidPool", f"EPP Service name {epp!r} is longer than 63 characters")]
        port = ref.port.number if ref and ref.port else ch.EPP_GRPC_PORT
        owner = ch.pool_owner(name, namespace, uid)
        routing = RoutingSpec(failure_mode=ref.failure_mode if ref else "FailClose")
        # The pool's model servers are not ours: their tokenizer has to be named.
        tokenizer = (meta.get("annotations") or {}).get(ch.ANNOTATION_TOKENIZER)
        target = ch.EPPTarget(
            name=epp,
            pool_name=name,
            owner=owner,
            instance=name,
            pod_labels={ch.LABEL_POOL: name, ch.LABEL_ROLE: "epp"},
            image=self.config.epp_image,
            routing=routing,
            grpc_port=port,
            tokenizer=ch.tokenizer_source(tokenizer) if tokenizer else None,
        )
        events: list[Event] = []
        await self.apply_all(ch.epp_objects(target, self.config), uid)
        if ref is None:
            # Without a reference the gateway cannot find the picker we just deployed.
            filled = EndpointPickerRef(name=epp, port=Port(number=port))
            await self.client.patch(
                INFERENCE_POOLS, namespace, name, {"spec": {"endpointPickerRef": filled.wire()}}
            )
            events.append(
                Event("Normal", "EndpointPickerRefSet", f"spec.endpointPickerRef now names Service {epp}.")
            )
        return events


def _failure(
    old_conditions: list[dict[str, Any]] | None, generation: int | None, reason: str, msg: str, progress: str
) -> Outcome:
    conds = [
        Cond("Ready", "False", reason, msg),
        Cond("Progressing", "False", reason, progress),
        Cond("Degraded", "True", reason, msg),
    ]
    status = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old_conditions, conds, generation),
    }
    return Outcome(_drop_none(status), [Event("Warning", reason, msg)])


def _fmt(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}".rstrip("0").rstrip(".") or "0"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _drop_none(v)
        if v is not None:
            out[k] = v
    return out

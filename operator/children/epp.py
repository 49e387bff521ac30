"""The endpoint picker (EPP): its config, tokenizer source, command line and every object of
one picker (ServiceAccount, Role, RoleBinding, ConfigMap, Deployment, Service, PDB)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import yaml

from kvgate.api.k8s.crds import (
    POOL_GROUP,
    TENANTS_DIR,
    FlowControlSpec,
    ModelDeploymentSpec,
    ModelSource,
    RoutingSpec,
    TenantsSpec,
)
from kvgate.operator.children.common import (
    API_KEY_ENV,
    EPP_CONFIG_KEY,
    EPP_GRPC_PORT,
    EPP_HEALTH_PORT,
    EPP_METRICS_PORT,
    LABEL_MD,
    LABEL_ROLE,
    MODEL_DIR,
    Owner,
    container_security,
    epp_name,
    hf_token_env,
    object_meta,
    pod_security,
    standard_labels,
)
from kvgate.operator.config import OperatorConfig


def epp_config_yaml(routing: RoutingSpec) -> str:
    """GIE's EndpointPickerConfig: the scorers with their weights in one default profile."""
    if routing.config:
        return routing.config
    plugins: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    for scorer in routing.scorers:
        plugin: dict[str, Any] = {"type": scorer.type}
        if scorer.parameters:
            plugin["parameters"] = dict(scorer.parameters)
        plugins.append(plugin)
        refs.append({"pluginRef": scorer.type, "weight": scorer.weight})
    plugins.append({"type": routing.picker})
    refs.append({"pluginRef": routing.picker})
    doc = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": refs}],
    }
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass(frozen=True)
class TokenizerSource:
    """Where an endpoint picker reads its tokenizer, and what its pod needs for that."""

    arg: str  # --tokenizer: a Hub id, or a path in the picker's container
    revision: str | None = None  # --tokenizer-revision
    claim: str | None = None  # a PersistentVolumeClaim mounted read-only at MODEL_DIR
    hf_token_secret: str | None = None  # a Secret (key `token`) exported as HF_TOKEN


def tokenizer_source(text: str, hf_token_secret: str | None = None) -> TokenizerSource:
    """A model or tokenizer source (`hf://`, bare `org/name[@rev]`, `pvc://`, a path) as the
    picker sees it."""
    if text.startswith("pvc://"):
        try:
            claim, path = ModelSource(source=text).pvc()
        except ValueError:  # an unvalidated annotation: the picker will say it is not found
            return TokenizerSource(text)
        return TokenizerSource(f"{MODEL_DIR}/{path}".rstrip("/"), claim=claim)
    if text.startswith("/"):
        return TokenizerSource(text)
    repo, _, revision = text.removeprefix("hf://").partition("@")
    return TokenizerSource(repo, revision or None, hf_token_secret=hf_token_secret)


@dataclass(frozen=True)
class EPPTarget:
    """What one endpoint picker serves: a pool, and where its objects are named and owned."""

    name: str  # the EPP's Deployment/Service/SA/Role/ConfigMap name
    pool_name: str
    owner: Owner
    instance: str  # app.kubernetes.io/instance
    pod_labels: dict[str, str]
    image: str
    routing: RoutingSpec
    grpc_port: int = EPP_GRPC_PORT
    tokenizer: TokenizerSource | None = None
    kv_events_port: int = 5557  # the engines' KV-event publisher port the EPP subscribes to
    kv_replay_port: int = 0  # the engines' KV-event replay port (0: none)
    termination_grace_seconds: int = 130
    # The engines' KVGATE_API_KEY env entry (value or secretKeyRef), so the EPP can scrape engines
    # whose /metrics requires the key (`kvgate engine serve --metrics-require-api-key`).
    api_key_env: dict[str, Any] | None = None
    # Prefill/decode disaggregation (spec.disaggregation): the picker's --pd-threshold.
    pd_threshold: int | None = None
    # spec.tenants: a Secret mounted read-only at TENANTS_DIR, its key the picker's --tenants file.
    tenants: TenantsSpec | None = None


def epp_target_for_md(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> EPPTarget:
    # A model baked into the engine image is out of the picker's reach: the spec then names the
    # tokenizer whenever the picker needs one (ModelDeploymentSpec refuses it otherwise).
    source = spec.routing.tokenizer or (spec.model.source if spec.model.kind() != "path" else None)
    tokenizer = tokenizer_source(source, spec.model.hf_token_secret) if source else None
    return EPPTarget(
        name=epp_name(name),
        pool_name=name,
        owner=owner,
        instance=name,
        pod_labels={LABEL_MD: name, LABEL_ROLE: "epp"},
        image=spec.routing.epp_image or config.epp_image,
        routing=spec.routing,
        tokenizer=tokenizer,
        kv_events_port=spec.engine.kv_events_port,
        kv_replay_port=spec.engine.kv_events_replay_port,
        api_key_env=next((e.wire() for e in spec.engine.env if e.name == API_KEY_ENV), None),
        tenants=spec.tenants,
        # A request streaming when the EPP restarts must be able to finish through it.
        termination_grace_seconds=spec.engine.drain_seconds + spec.engine.shutdown_timeout_seconds + 10,
    )


def _seconds(value: float) -> str:
    """Seconds as a plain decimal (90, 0.5, 0.001: no exponent), which `--flow-ttl` reads."""
    text = format(Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def flow_control_args(flow: FlowControlSpec | None) -> list[str]:
    """spec.routing.flowControl as `kvgate epp serve` flags; only what the spec sets (the
    picker keeps its own defaults for the rest)."""
    if flow is None:
        return []
    if not flow.enabled:
        return ["--no-flow-control"]
    args: list[str] = []
    if flow.max_queued is not None:
        args += ["--flow-max-queued", str(flow.max_queued)]
    if flow.max_queued_per_flow is not None:
        args += ["--flow-max-queued-per-flow", str(flow.max_queued_per_flow)]
    count = flow.max_queued_byte_count()
    if count is not None:
        args += ["--flow-max-queued-bytes", str(count)]
    ttl = flow.ttl_seconds()
    if ttl is not None:
        args += ["--flow-ttl", _seconds(ttl)]
    if flow.dispatch is not None:
        args += ["--flow-dispatch", flow.dispatch]
    if flow.dispatch_queue_depth is not None:
        args += ["--flow-dispatch-queue-depth", str(flow.dispatch_queue_depth)]
    if flow.max_unconfirmed_picks is not None:
        args += ["--flow-max-unconfirmed-picks", str(flow.max_unconfirmed_picks)]
    if flow.dispatch_prefill_tokens is not None:
        args += ["--flow-dispatch-prefill-tokens", str(flow.dispatch_prefill_tokens)]
    if flow.short_reserve is not None:
        args += ["--flow-short-reserve", str(flow.short_reserve)]
    if flow.short_prompt_tokens is not None:
        args += ["--flow-short-prompt-tokens", str(flow.short_prompt_tokens)]
    half_life = flow.fair_share_half_life_seconds()
    if half_life is not None:
        args += ["--flow-fair-share-half-life", _seconds(half_life)]
    if flow.fair_share_max_queue is not None:
        args += ["--flow-fair-share-max-queue", _seconds(flow.fair_share_max_queue)]
    return args


def epp_args(target: EPPTarget) -> list[str]:
    args = [
        "--pool-name",
        target.pool_name,
        "--pool-namespace",
        target.owner.namespace,
        "--config-file",
        f"/config/{EPP_CONFIG_KEY}",
        # every address of the pod: Envoy and the kubelet's probes come from outside it
        "--host",
        "0.0.0.0",
        "--grpc-port",
        str(target.grpc_port),
        "--grpc-health-port",
        str(EPP_HEALTH_PORT),
        "--metrics-port",
        str(EPP_METRICS_PORT),
    ]
    if target.kv_events_port != 5557:  # the EPP's default
        args += ["--kv-events-port", str(target.kv_events_port)]
    if target.kv_replay_port:
        args += ["--kv-replay-port", str(target.kv_replay_port)]
    if not target.routing.secure_serving:
        args.append("--secure-serving=false")
    args += flow_control_args(target.routing.flow_control)
    if target.tenants is not None:
        args += ["--tenants", target.tenants.path()]
    if target.pd_threshold is not None:
        args += ["--pd-threshold", str(target.pd_threshold)]
    if target.tokenizer:
        args += ["--tokenizer", target.tokenizer.arg]
        if target.tokenizer.revision:
            args += ["--tokenizer-revision", target.tokenizer.revision]
    return args


def tenants_volume(tenants: TenantsSpec) -> dict[str, Any]:
    """The tenants Secret as a volume: the whole Secret (no `items`), so a missing key is the
    picker's one-line "cannot read tenants file" exit, not a pod stuck on its mount; readable
    by the pod's group (fsGroup) only."""
    return {"name": "tenants", "secret": {"secretName": tenants.secret_name, "defaultMode": 0o440}}


def epp_objects(target: EPPTarget, config: OperatorConfig) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, ConfigMap, Deployment, Service and PDB of one EPP."""
    labels = standard_labels(target.instance, "epp", {**target.pod_labels, **config.extra_labels})
    meta = object_meta(target.name, target.owner, labels)
    service_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    # Least privilege: the EPP only reads its pool, the objectives and the pods it routes to.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta,
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }
    role_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": target.name},
        "subjects": [{"kind": "ServiceAccount", "name": target.name, "namespace": target.owner.namespace}],
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {EPP_CONFIG_KEY: epp_config_yaml(target.routing)},
    }
    claim = target.tokenizer.claim if target.tokenizer else None
    container = {
        "name": "epp",
        "image": target.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kvgate", "epp", "serve"],
        "args": epp_args(target),
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "HOME", "value": "/tmp"},
            # The tokenizer files fetched from the Hub land on the writable /tmp volume.
            {"name": "HF_HOME", "value": "/tmp/hf"},
            *hf_token_env(target.tokenizer.hf_token_secret if target.tokenizer else None),
            *([target.api_key_env] if target.api_key_env else []),
        ],
        "ports": [
            {"name": "grpc", "containerPort": target.grpc_port, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {
            "grpc": {"port": EPP_HEALTH_PORT, "service": "liveness"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
        },
        # `readiness` turns SERVING only once the endpoint list is synced and KV-event replay is
        # done, so a new replica takes picks only when it agrees with the ones already serving.
        "readinessProbe": {
            "grpc": {"port": EPP_HEALTH_PORT, "service": "readiness"},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [
            {"name": "config", "mountPath": "/config", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *([{"name": "models", "mountPath": MODEL_DIR, "readOnly": True}] if claim else []),
            *([{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}] if target.tenants else []),
        ],
        "securityContext": container_security(),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            # Active-active: every replica rebuilds the same prefix index from the engines' KV
            # events, so they agree without talking to each other. A rollout adds the new replica
            # and waits for it to be Ready (synced) before taking an old one away.
            "replicas": target.routing.epp_replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": dict(target.pod_labels)},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(EPP_METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": target.name,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": target.termination_grace_seconds,
                    "securityContext": pod_security(config),
                    # Preferred, not required: a one-node cluster still runs every replica.
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": dict(target.pod_labels)},
                                    },
                                }
                            ]
                        }
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": target.name}},
                        {"name": "tmp", "emptyDir": {}},
                        *(
                            [
                                {
                                    "name": "models",
                                    "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
                                }
                            ]
                            if claim
                            else []
                        ),
                        *([tenants_volume(target.tenants)] if target.tenants else []),
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": dict(target.pod_labels),
            "ports": [
                {"name": "grpc-ext-proc", "port": target.grpc_port, "targetPort": "grpc", "protocol": "TCP"},
                {
                    "name": "http-metrics",
                    "port": EPP_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
    # Voluntary disruptions (drains, upgrades) keep one picker serving. With one replica this
    # blocks a node drain until the picker is moved by hand: the price of asking for one.
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        "spec": {
            "minAvailable": 1,
            "selector": {"matchLabels": dict(target.pod_labels)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return [service_account, role, role_binding, config_map, deployment, service, pdb]

"""Pure builders: a ModelDeployment (or a hand-made InferencePool) in, child manifests out.

Nothing here talks to an API server, so every object the operator writes can be built and
validated in a test. Names: the engine Deployment, InferencePool, PDB, autoscaler and
HTTPRoute share the ModelDeployment's name; the endpoint picker's objects add `-epp`.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from kvgate.api.crds import (
    KVGATE_GROUP,
    KVGATE_VERSION,
    POOL_GROUP,
    POOL_VERSION,
    AutoscalingSpec,
    EndpointPickerRef,
    InferencePoolSpec,
    LabelSelector,
    ModelDeploymentSpec,
    ModelSource,
    NetworkPeer,
    Port,
    RoutingSpec,
)
from kvgate.api.metrics import (
    LABEL_POOL_NAME,
    POOL_AVERAGE_KV_CACHE_UTILIZATION,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_SATURATION,
    SATURATION_KV_CACHE_UTILIZATION,
    SATURATION_QUEUE_DEPTH,
)
from kvgate.operator.config import OperatorConfig

MANAGED_BY = "kvgate-operator"
LABEL_MD = "kvgate.dev/model-deployment"
LABEL_POOL = "kvgate.dev/inference-pool"
LABEL_ROLE = "kvgate.dev/role"
ANNOTATION_EPP = "kvgate.dev/epp"
ANNOTATION_TOKENIZER = "kvgate.dev/tokenizer"  # on a managed pool: the EPP's --tokenizer
EPP_MANAGED = "managed"

EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_KEY = "epp-config.yaml"
# The engine's API key variable (`kvgate engine serve --api-key` reads it too); the EPP sends it
# as a bearer token when it scrapes engines' /metrics.
API_KEY_ENV = "KVGATE_API_KEY"
MODEL_DIR = "/models"
MAX_MD_NAME = 59  # `<name>-epp` must stay a 63-character DNS label (it is a Service name)


@dataclass(frozen=True)
class Owner:
    """The object children point their ownerReference (and garbage collection) at."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def model_deployment_owner(name: str, namespace: str, uid: str) -> Owner:
    return Owner(f"{KVGATE_GROUP}/{KVGATE_VERSION}", "ModelDeployment", name, uid, namespace)


def pool_owner(name: str, namespace: str, uid: str) -> Owner:
    return Owner(f"{POOL_GROUP}/{POOL_VERSION}", "InferencePool", name, uid, namespace)


def _labels(instance: str, component: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"kvgate-{component}",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvgate",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **extra,
    }


def _meta(name: str, owner: Owner, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }


def engine_selector(md_name: str) -> dict[str, str]:
    return {LABEL_MD: md_name, LABEL_ROLE: "engine"}


def epp_name(owner_name: str) -> str:
    return f"{owner_name}-epp"


def _pod_security(config: OperatorConfig) -> dict[str, Any]:
    uid = config.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


def _hf_local_dir(repo: str) -> str:
    return f"{MODEL_DIR}/{repo.replace('/', '--')}"


def engine_model_path(spec: ModelDeploymentSpec) -> str:
    """What `--model` points at inside the engine container."""
    kind = spec.model.kind()
    if kind == "hf":
        return _hf_local_dir(spec.model.hf_repo()[0])
    if kind == "pvc":
        _, path = spec.model.pvc()
        return f"{MODEL_DIR}/{path}".rstrip("/")
    return spec.model.source


def engine_args(spec: ModelDeploymentSpec) -> list[str]:
    eng = spec.engine
    args = [
        "--model",
        engine_model_path(spec),
        "--served-model-name",
        spec.model.effective_served_name(),
        "--host",
        "0.0.0.0",
        "--port",
        str(eng.port),
        "--kv-events-endpoint",
        f"tcp://*:{eng.kv_events_port}",
        *(
            ["--kv-events-replay-endpoint", f"tcp://*:{eng.kv_events_replay_port}"]
            if eng.kv_events_replay_port
            else []
        ),
        "--shutdown-timeout",
        str(eng.shutdown_timeout_seconds),
    ]
    # No tensor-parallelism flag: the spec refuses tensorParallelSize > 1 (the engine has none).
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    return args + list(eng.args)


def _download_script(repo: str, revision: str | None) -> str:
    # Runs in the engine image (it ships huggingface_hub with transformers); idempotent, so a
    # restarted pod with a surviving emptyDir skips what it already has.
    return (
        "from huggingface_hub import snapshot_download; "
        f"snapshot_download(repo_id={repo!r}, revision={revision!r}, local_dir={_hf_local_dir(repo)!r})"
    )


def _engine_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    env += _hf_token_env(spec.model.hf_token_secret)
    env += [e.wire() for e in spec.engine.env]
    return env


def _hf_token_env(secret: str | None) -> list[dict[str, Any]]:
    if not secret:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}]


def _engine_resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.engine.resources.requests or {}) if spec.engine.resources else {}
    limits = dict(spec.engine.resources.limits or {}) if spec.engine.resources else {}
    if spec.engine.accelerator == "nvidia":
        limits["nvidia.com/gpu"] = spec.engine.tensor_parallel_size
        requests.pop("nvidia.com/gpu", None)  # extended resources: requests default to limits
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = {k: str(v) if isinstance(v, str) else v for k, v in requests.items()}
    if limits:
        out["limits"] = limits
    return out


def engine_deployment(
    name: str,
    owner: Owner,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    replicas: int | None,
) -> dict[str, Any]:
    """The engine Deployment. `replicas=None` leaves the count to an autoscaler (omitted)."""
    eng = spec.engine
    selector = engine_selector(name)
    labels = _labels(name, "engine", {**selector, **config.extra_labels})
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    startup_period = 10
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    init_containers: list[dict[str, Any]] = []
    kind = spec.model.kind()
    if kind == "hf":
        repo, revision = spec.model.hf_repo()
        volumes.append({"name": "models", "emptyDir": {}})
        mounts.append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})
        init_containers.append(
            {
                "name": "fetch-model",
                "image": eng.image or config.engine_image,
                "imagePullPolicy": eng.image_pull_policy,
                "command": ["python", "-c", _download_script(repo, revision)],
                "env": _engine_env(spec),
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "models", "mountPath": MODEL_DIR},
                ],
                "securityContext": _container_security(),
            }
        )
    elif kind == "pvc":
        claim, _ = spec.model.pvc()
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})

    container: dict[str, Any] = {
        "name": "engine",
        "image": eng.image or config.engine_image,
        "imagePullPolicy": eng.image_pull_policy,
        "command": ["kvgate", "engine", "serve"],
        "args": engine_args(spec),
        "env": _engine_env(spec),
        "ports": [
            {"name": "http", "containerPort": eng.port, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": eng.kv_events_port, "protocol": "TCP"},
            *(
                [{"name": "kv-replay", "containerPort": eng.kv_events_replay_port, "protocol": "TCP"}]
                if eng.kv_events_replay_port
                else []
            ),
        ],
        # Weight loading can take many minutes: only the startup probe waits that long; once it
        # passes, readiness and liveness probe fast.
        "startupProbe": {
            **probe,
            "periodSeconds": startup_period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(eng.startup_timeout_seconds / startup_period)),
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    resources = _engine_resources(spec)
    if resources:
        container["resources"] = resources
    if eng.drain_seconds:
        # Let gateways and the EPP take the pod out of rotation before the engine stops admitting.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": eng.drain_seconds}}}

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # preStop drain, then the engine's own SIGTERM drain, plus slack for process exit.
        "terminationGracePeriodSeconds": eng.drain_seconds + eng.shutdown_timeout_seconds + 10,
        "securityContext": _pod_security(config),
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if eng.node_selector:
        pod_spec["nodeSelector"] = dict(eng.node_selector)
    tolerations = list(eng.tolerations or [])
    if eng.accelerator == "nvidia" and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        pod_spec["tolerations"] = tolerations

    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "progressDeadlineSeconds": eng.startup_timeout_seconds + 600,
        "template": {
            "metadata": {
                "labels": labels,
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(eng.port),
                    "prometheus.io/path": "/metrics",
                },
            },
            "spec": pod_spec,
        },
    }
    if replicas is not None:
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, owner, labels),
        "spec": deployment_spec,
    }


def engine_pdb(name: str, owner: Owner, config: OperatorConfig) -> dict[str, Any]:
    labels = _labels(name, "engine", {**engine_selector(name), **config.extra_labels})
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, owner, labels),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": engine_selector(name)},
            # A pod that never became ready (e.g. still loading weights) may always be evicted.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# ---------------------------------------------------------------------------------------------
# InferencePool
# ---------------------------------------------------------------------------------------------


def inference_pool(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    labels = _labels(name, "pool", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": _meta(name, owner, labels),
        "spec": InferencePoolSpec(
            selector=LabelSelector(match_labels=engine_selector(name)),
            target_ports=[Port(number=spec.engine.port)],
            app_protocol="http",
            endpoint_picker_ref=EndpointPickerRef(
                group="",
                kind="Service",
                name=epp_name(name),
                port=Port(number=EPP_GRPC_PORT),
                failure_mode=spec.routing.failure_mode,
            ),
        ).wire(),
    }


# ---------------------------------------------------------------------------------------------
# Endpoint picker (EPP)
# ---------------------------------------------------------------------------------------------


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
        # A request streaming when the EPP restarts must be able to finish through it.
        termination_grace_seconds=spec.engine.drain_seconds + spec.engine.shutdown_timeout_seconds + 10,
    )


def epp_args(target: EPPTarget) -> list[str]:
    args = [
        "--pool-name",
        target.pool_name,
        "--pool-namespace",
        target.owner.namespace,
        "--config-file",
        f"/config/{EPP_CONFIG_KEY}",
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
    if target.tokenizer:
        args += ["--tokenizer", target.tokenizer.arg]
        if target.tokenizer.revision:
            args += ["--tokenizer-revision", target.tokenizer.revision]
    return args


def epp_objects(target: EPPTarget, config: OperatorConfig) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, ConfigMap, Deployment, Service and PDB of one EPP."""
    labels = _labels(target.instance, "epp", {**target.pod_labels, **config.extra_labels})
    meta = _meta(target.name, target.owner, labels)
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
            *_hf_token_env(target.tokenizer.hf_token_secret if target.tokenizer else None),
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
        ],
        "securityContext": _container_security(),
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
                    "securityContext": _pod_security(config),
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


# ---------------------------------------------------------------------------------------------
# NetworkPolicies (ingress only)
# ---------------------------------------------------------------------------------------------
#
# Egress stays open: the picker needs DNS, the API server (whose address a NetworkPolicy can
# only name by IP block) and the engines; engines may need a model hub. Kubelet probes come from
# the node and are allowed by the common CNIs (Calico, Cilium, GKE Dataplane V2) whatever the
# policy says, so the health port is opened to the gateway only (its EPP health checks).


def _peers(peers: list[NetworkPeer]) -> list[dict[str, Any]]:
    return [p.wire() for p in peers]


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in sorted(set(ports))]


def network_policies(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The picker's and the engines' ingress policies; none when spec.networkPolicy is off."""
    policy = spec.network_policy
    if not policy.enabled:
        return []
    epp_pods = {LABEL_MD: name, LABEL_ROLE: "epp"}
    gateway, metrics = _peers(policy.gateway_from), _peers(policy.metrics_from)
    epp_rules: list[dict[str, Any]] = [{"from": gateway, "ports": _tcp(EPP_GRPC_PORT, EPP_HEALTH_PORT)}]
    eng = spec.engine
    engine_rules: list[dict[str, Any]] = [
        {"from": gateway, "ports": _tcp(eng.port)},
        # The picker scrapes /metrics on the serving port and subscribes to KV events.
        {
            "from": [{"podSelector": {"matchLabels": epp_pods}}],
            "ports": _tcp(*(p for p in (eng.port, eng.kv_events_port, eng.kv_events_replay_port) if p)),
        },
    ]
    if metrics:
        epp_rules.append({"from": metrics, "ports": _tcp(EPP_METRICS_PORT)})
        # /metrics shares the serving port: scrapers reach the API too (the engine's API key guards it).
        engine_rules.append({"from": metrics, "ports": _tcp(eng.port)})
    out = []
    for policy_name, component, pods, rules in (
        (epp_name(name), "epp", epp_pods, epp_rules),
        (name, "engine", engine_selector(name), engine_rules),
    ):
        labels = _labels(name, component, {**pods, **config.extra_labels})
        out.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": _meta(policy_name, owner, labels),
                "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": rules},
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# Autoscaling
# ---------------------------------------------------------------------------------------------


def pool_gauge(metric: str, pool: str) -> str:
    """PromQL for one of the EPP's pool gauges (the max over the pool's EPP replicas)."""
    return f'max({metric}{{{LABEL_POOL_NAME}="{pool}"}})'


def autoscaler_query(pool: str, metric: str) -> str:
    """The PromQL the autoscaler scales on: a pool-wide average from the EPP."""
    queue = pool_gauge(POOL_AVERAGE_QUEUE_SIZE, pool)
    kv = pool_gauge(POOL_AVERAGE_KV_CACHE_UTILIZATION, pool)
    if metric == "queue-size":
        return queue
    if metric == "kv-cache-utilization":
        return kv
    # api.metrics.saturation() = max(queue/5, kv/0.8), written without a binary max:
    # b + clamp_min(a - b, 0)
    a = f"({queue} / {_num(SATURATION_QUEUE_DEPTH)})"
    b = f"({kv} / {_num(SATURATION_KV_CACHE_UTILIZATION)})"
    return f"{b} + clamp_min({a} - {b}, 0)"


def _num(value: float) -> str:
    return f"{value:g}"


def scaled_object(
    name: str, owner: Owner, autoscaling: AutoscalingSpec, config: OperatorConfig
) -> dict[str, Any]:
    labels = _labels(name, "autoscaler", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(name, owner, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "prometheus",
                    # The query is a per-endpoint average already: scale on its value, not per pod.
                    "metricType": "Value",
                    "metadata": {
                        "serverAddress": autoscaling.prometheus_address or config.keda_prometheus_address,
                        "query": autoscaler_query(name, autoscaling.metric),
                        "threshold": autoscaling.target,
                    },
                }
            ],
        },
    }


def _external_metric_name(metric: str) -> str:
    return {
        "queue-size": POOL_AVERAGE_QUEUE_SIZE,
        "kv-cache-utilization": POOL_AVERAGE_KV_CACHE_UTILIZATION,
        "saturation": POOL_SATURATION,
    }[metric]


def horizontal_pod_autoscaler(
    name: str, owner: Owner, autoscaling: AutoscalingSpec, config: OperatorConfig
) -> dict[str, Any]:
    """autoscaling/v2 HPA on the pool metric as an External metric (needs a metrics adapter)."""
    labels = _labels(name, "autoscaler", {LABEL_MD: name, **config.extra_labels})
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(name, owner, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            # Scaling to zero is KEDA's job; an HPA's floor is one replica.
            "minReplicas": max(1, autoscaling.min_replicas),
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": _external_metric_name(autoscaling.metric),
                            "selector": {"matchLabels": {LABEL_POOL_NAME: name}},
                        },
                        "target": {"type": "Value", "value": autoscaling.target},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


# ---------------------------------------------------------------------------------------------
# HTTPRoute
# ---------------------------------------------------------------------------------------------


def http_route(name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig) -> dict[str, Any]:
    assert spec.http_route is not None
    route = spec.http_route
    labels = _labels(name, "route", {LABEL_MD: name, **config.extra_labels})
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
        "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": name}],
    }
    if route.request_timeout:
        rule["timeouts"] = {"request": route.request_timeout}
    body: dict[str, Any] = {
        "parentRefs": [p.wire() for p in route.parent_refs],
        "rules": [rule],
    }
    if route.hostnames:
        body["hostnames"] = list(route.hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _meta(name, owner, labels),
        "spec": body,
    }


# ---------------------------------------------------------------------------------------------
# The whole set
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capabilities:
    """What the cluster serves, which decides some children."""

    keda: bool = True
    gateway_api: bool = True


def autoscaler_kind(autoscaling: AutoscalingSpec, caps: Capabilities) -> str | None:
    if autoscaling.backend == "off":
        return None
    if autoscaling.backend == "keda" and caps.keda:
        return "ScaledObject"
    return "HorizontalPodAutoscaler"


def desired_replicas(spec: ModelDeploymentSpec, autoscaled: bool, exists: bool) -> int | None:
    """The engine replica count to write; None keeps the live count (an autoscaler owns it)."""
    if spec.replicas is not None:
        return spec.replicas
    if not autoscaled:
        return 1
    return None if exists else max(1, spec.autoscaling.min_replicas)


def model_deployment_children(
    name: str,
    owner: Owner,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    caps: Capabilities,
    engine_exists: bool = False,
) -> list[dict[str, Any]]:
    """Every child a ModelDeployment should have right now, in creation order."""
    scaler = autoscaler_kind(spec.autoscaling, caps)
    children = [
        *epp_objects(epp_target_for_md(name, owner, spec, config), config),
        inference_pool(name, owner, spec, config),
        engine_deployment(
            name, owner, spec, config, desired_replicas(spec, scaler is not None, engine_exists)
        ),
        engine_pdb(name, owner, config),
        *network_policies(name, owner, spec, config),
    ]
    if scaler == "ScaledObject":
        children.append(scaled_object(name, owner, spec.autoscaling, config))
    elif scaler == "HorizontalPodAutoscaler":
        children.append(horizontal_pod_autoscaler(name, owner, spec.autoscaling, config))
    if spec.http_route is not None and caps.gateway_api:
        children.append(http_route(name, owner, spec, config))
    return children


# Children a ModelDeployment may or may not have, as (kind, name suffix); one not desired now is
# deleted if we own it.
OPTIONAL_CHILDREN = (
    ("ScaledObject", ""),
    ("HorizontalPodAutoscaler", ""),
    ("HTTPRoute", ""),
    ("NetworkPolicy", ""),
    ("NetworkPolicy", "-epp"),
)


def command_line(manifest: dict[str, Any]) -> str:
    """The container's command line, for logs and tests."""
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return shlex.join([*container.get("command", []), *container.get("args", [])])

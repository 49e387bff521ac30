"""The engine Deployment (and the init container that fetches a Hub model) and its PDB."""

from __future__ import annotations

import math
from typing import Any

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.api.k8s.quantity import format_bytes, memory_bytes
from kvgate.operator.children.adapters import adapter_fetcher, adapter_volumes, lora_args, readiness_gates
from kvgate.operator.children.common import (
    MODEL_DIR,
    Owner,
    container_security,
    engine_selector,
    hf_token_env,
    object_meta,
    pod_security,
    standard_labels,
)
from kvgate.operator.config import OperatorConfig


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
    args += kv_offload_args(spec)
    # LoRA flags only: which adapters run is applied at run time, never in the pod template.
    return args + lora_args(spec) + list(eng.args)


def _gib(size: float) -> str:
    """GiB for `--kv-offloading-size`: exact (repr round-trips), without a trailing `.0`."""
    text = repr(size)
    return text.removesuffix(".0")


def kv_offload_args(spec: ModelDeploymentSpec) -> list[str]:
    """spec.kvOffload as the engine's flags (vLLM's names); the defaults are left to the engine.
    A simulated engine (`--simulate` in spec.engine.args) sizes its tier from the same flag."""
    tier = spec.kv_offload
    if tier is None:
        return []
    args = ["--kv-offloading-size", _gib(tier.size_gib()), "--kv-offloading-backend", tier.backend]
    if tier.offload_on != "evict":
        args += ["--kv-offload-on", tier.offload_on]
    return args


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
    env += hf_token_env(spec.model.hf_token_secret)
    env += [e.wire() for e in spec.engine.env]
    return env


def _with_tier_memory(requests: dict[str, Any], limits: dict[str, Any], tier_bytes: int) -> None:
    """The host KV tier is memory the engine allocates at start on top of its own: added to the
    memory request and limit that are set; with neither, a request of the tier alone (so the pod
    lands where the tier fits) and no limit (one of the tier alone would OOM-kill the engine).
    A limit with no request leaves the request to Kubernetes, which defaults it to the limit."""
    if "memory" in requests:
        requests["memory"] = format_bytes(memory_bytes(requests["memory"]) + tier_bytes)
    elif "memory" not in limits:
        requests["memory"] = format_bytes(tier_bytes)
    if "memory" in limits:
        limits["memory"] = format_bytes(memory_bytes(limits["memory"]) + tier_bytes)


def _engine_resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.engine.resources.requests or {}) if spec.engine.resources else {}
    limits = dict(spec.engine.resources.limits or {}) if spec.engine.resources else {}
    if spec.kv_offload is not None:
        _with_tier_memory(requests, limits, spec.kv_offload.size_bytes())
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
    labels = standard_labels(name, "engine", {**selector, **config.extra_labels})
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
                "securityContext": container_security(),
            }
        )
    elif kind == "pvc":
        claim, _ = spec.model.pvc()
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})
    lora_volumes, lora_mounts = adapter_volumes(name, spec)
    volumes += lora_volumes
    mounts += lora_mounts
    fetcher = adapter_fetcher(spec, config)
    if fetcher is not None:
        init_containers.append(fetcher)

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
        "securityContext": container_security(),
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
        "securityContext": pod_security(config),
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    gates = readiness_gates(spec)
    if gates:
        pod_spec["readinessGates"] = gates
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
        "metadata": object_meta(name, owner, labels),
        "spec": deployment_spec,
    }


def engine_pdb(name: str, owner: Owner, config: OperatorConfig) -> dict[str, Any]:
    labels = standard_labels(name, "engine", {**engine_selector(name), **config.extra_labels})
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(name, owner, labels),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": engine_selector(name)},
            # A pod that never became ready (e.g. still loading weights) may always be evicted.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

"""LoRA adapters in the engine pods: where each adapter's folder is, the engine's LoRA flags,
the volumes and the hf:// fetcher sidecar, and the ConfigMap that tells the sidecar what to fetch.

Nothing here depends on which adapters the spec lists except the ConfigMap: the pod template
(flags, volumes, sidecar) depends only on spec.lora and whether LoRA is on, so adding or
removing an adapter never rolls the engines. The operator loads and unloads adapters at run
time through each engine's /v1/load_lora_adapter (operator/adapter_sync.py); a kubelet refreshes a
mounted ConfigMap in place, so the sidecar sees a new hf:// adapter without a restart.
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.api.k8s.crds import (
    ADAPTER_CLAIMS_DIR,
    ADAPTER_HF_DIR,
    AdapterSpec,
    ModelDeploymentSpec,
)
from kvgate.operator.children.common import (
    MODEL_DIR,
    Owner,
    container_security,
    engine_selector,
    hf_token_env,
    object_meta,
    standard_labels,
)
from kvgate.operator.config import OperatorConfig

# The engine pods' readiness gate: the operator sets it once the pod has its adapters.
ADAPTERS_GATE = "kvgate.dev/lora-adapters"
ADAPTER_LIST_DIR = "/etc/kvgate/adapters"
ADAPTER_LIST_KEY = "hf-adapters.json"
FETCH_INTERVAL_S = 10


def adapters_config_map_name(name: str) -> str:
    return f"{name}-adapters"


def hf_adapter_dir(adapter: AdapterSpec) -> str:
    """The folder name under ADAPTER_HF_DIR one (repo, revision) is fetched into."""
    repo, revision = adapter.hf_repo()
    folder = repo.replace("/", "--")
    return f"{folder}@{revision.replace('/', '--')}" if revision else folder


def adapter_path(spec: ModelDeploymentSpec, adapter: AdapterSpec) -> str:
    """Where the engine container reads this adapter's folder (the load request's lora_path)."""
    kind = adapter.kind()
    if kind == "hf":
        return f"{ADAPTER_HF_DIR}/{hf_adapter_dir(adapter)}"
    if kind == "pvc":
        claim, path = adapter.pvc()
        if spec.model.kind() == "pvc" and spec.model.pvc()[0] == claim:
            return f"{MODEL_DIR}/{path}".rstrip("/")
        return f"{ADAPTER_CLAIMS_DIR}/{claim}/{path}".rstrip("/")
    return adapter.source


def lora_args(spec: ModelDeploymentSpec) -> list[str]:
    """The engine's LoRA flags; no --lora-modules: adapters are loaded at run time."""
    if not spec.lora_enabled():
        return []
    lora = spec.lora_settings()
    args = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    if lora.unload_grace_seconds is not None:  # unset: the engine's own default
        args += ["--lora-unload-grace", str(lora.unload_grace_seconds)]
    return args


def adapter_volumes(
    name: str, spec: ModelDeploymentSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, engine mounts) for adapters: the fetched hf:// folders and lora.claims."""
    if not spec.lora_enabled():
        return [], []
    volumes: list[dict[str, Any]] = [
        {"name": "hf-adapters", "emptyDir": {}},
        {"name": "adapter-list", "configMap": {"name": adapters_config_map_name(name)}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "hf-adapters", "mountPath": ADAPTER_HF_DIR, "readOnly": True}]
    for i, claim in enumerate(spec.lora_settings().claims):
        vol = f"adapter-claim-{i}"
        volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": vol, "mountPath": f"{ADAPTER_CLAIMS_DIR}/{claim}", "readOnly": True})
    return volumes, mounts


def readiness_gates(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """With LoRA on, a pod is Ready only once the operator says its adapters are loaded."""
    return [{"conditionType": ADAPTERS_GATE}] if spec.lora_enabled() else []


def adapter_fetcher(spec: ModelDeploymentSpec, config: OperatorConfig) -> dict[str, Any] | None:
    """A native sidecar (an init container that keeps running) fetching hf:// adapters the
    ConfigMap lists into the shared emptyDir, each folder renamed into place when complete."""
    if not spec.lora_enabled():
        return None
    eng = spec.engine
    return {
        "name": "fetch-adapters",
        "image": eng.image or config.engine_image,
        "imagePullPolicy": eng.image_pull_policy,
        "restartPolicy": "Always",
        "command": [
            "kvgate",
            "engine",
            "fetch-adapters",
            "--list",
            f"{ADAPTER_LIST_DIR}/{ADAPTER_LIST_KEY}",
            "--dir",
            ADAPTER_HF_DIR,
            "--interval",
            str(FETCH_INTERVAL_S),
        ],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": "/tmp/hf"},
            *hf_token_env(spec.model.hf_token_secret),
        ],
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "hf-adapters", "mountPath": ADAPTER_HF_DIR},
            {"name": "adapter-list", "mountPath": ADAPTER_LIST_DIR, "readOnly": True},
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "securityContext": container_security(),
    }


def hf_adapter_list(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """What the sidecar fetches: each hf:// adapter's repo, revision and folder, once each."""
    out: dict[str, dict[str, Any]] = {}
    for adapter in spec.adapters:
        if adapter.kind() == "hf":
            repo, revision = adapter.hf_repo()
            out.setdefault(
                hf_adapter_dir(adapter), {"repo": repo, "revision": revision, "dir": hf_adapter_dir(adapter)}
            )
    return sorted(out.values(), key=lambda e: e["dir"])


def adapters_config_map(
    name: str, owner: Owner, spec: ModelDeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    labels = standard_labels(name, "engine", {**engine_selector(name), **config.extra_labels})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(adapters_config_map_name(name), owner, labels),
        "data": {ADAPTER_LIST_KEY: json.dumps(hf_adapter_list(spec), indent=1, sort_keys=True) + "\n"},
    }

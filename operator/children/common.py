"""What every child shares: kvgate's labels and annotations, the picker's ports, owner
references, standard metadata and security contexts."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from kvgate.api.k8s.crds import KVGATE_GROUP, KVGATE_VERSION, POOL_GROUP, POOL_VERSION
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


def standard_labels(instance: str, component: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"kvgate-{component}",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvgate",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **extra,
    }


def object_meta(name: str, owner: Owner, labels: dict[str, str]) -> dict[str, Any]:
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


def pod_security(config: OperatorConfig) -> dict[str, Any]:
    uid = config.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def hf_token_env(secret: str | None) -> list[dict[str, Any]]:
    if not secret:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}]


@dataclass(frozen=True)
class Capabilities:
    """What the cluster serves, which decides some children."""

    keda: bool = True
    gateway_api: bool = True


def command_line(manifest: dict[str, Any]) -> str:
    """The container's command line, for logs and tests."""
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return shlex.join([*container.get("command", []), *container.get("args", [])])

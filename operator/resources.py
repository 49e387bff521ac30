"""The Kubernetes resources the operator reads and writes, addressed by group/version/plural."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """`group/version/plural` (`v1/plural` for the core group): kopf's and kmock's spelling."""
        return f"{self.api_version}/{self.plural}"

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


MODEL_DEPLOYMENTS = Resource("kvgate.dev", "v1alpha1", "modeldeployments", "ModelDeployment")
INFERENCE_POOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
INFERENCE_OBJECTIVES = Resource(
    "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective"
)
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
SERVICES = Resource("", "v1", "services", "Service")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap")
EVENTS = Resource("", "v1", "events", "Event")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
HPAS = Resource("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")
SCALED_OBJECTS = Resource("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject")
HTTP_ROUTES = Resource("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute")
# Read only: engine pods (for their IPs, to load adapters) and the engines' API-key Secret.
PODS = Resource("", "v1", "pods", "Pod")
SECRETS = Resource("", "v1", "secrets", "Secret")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False)

BY_KIND: dict[str, Resource] = {
    r.kind: r
    for r in (
        MODEL_DEPLOYMENTS,
        INFERENCE_POOLS,
        INFERENCE_OBJECTIVES,
        DEPLOYMENTS,
        SERVICES,
        SERVICE_ACCOUNTS,
        CONFIG_MAPS,
        ROLES,
        ROLE_BINDINGS,
        PDBS,
        NETWORK_POLICIES,
        HPAS,
        SCALED_OBJECTS,
        HTTP_ROUTES,
    )
}


def resource_of(manifest: dict) -> Resource:
    return BY_KIND[manifest["kind"]]

"""OpenAPI schemas for the two foreign kinds kvgate writes but does not define: KEDA's
ScaledObject (keda.sh/v1alpha1) and Gateway API's HTTPRoute (gateway.networking.k8s.io/v1).

Written by us from those projects' API references, covering the fields a ScaledObject or an
HTTPRoute may carry at the levels kvgate writes; unknown fields are rejected (strict), types
and enums checked. Nested objects kvgate never writes (filters, retry, session persistence,
HPA behaviour) are accepted as opaque objects.
"""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer", "format": "int32"}
_STR = {"type": "string"}
_OPAQUE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _kind_schema(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": {"type": "object"},
            "spec": spec,
            "status": _OPAQUE,
        },
    }


SCALED_OBJECT: dict[str, Any] = _kind_schema(
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "apiVersion": _STR,
                    "kind": _STR,
                    "name": _STR,
                    "envSourceContainerName": _STR,
                },
            },
            "pollingInterval": _INT,
            "cooldownPeriod": _INT,
            "initialCooldownPeriod": _INT,
            "idleReplicaCount": _INT,
            "minReplicaCount": _INT,
            "maxReplicaCount": _INT,
            "fallback": {
                "type": "object",
                "required": ["failureThreshold", "replicas"],
                "properties": {"failureThreshold": _INT, "replicas": _INT, "behavior": _STR},
            },
            "advanced": _OPAQUE,
            "triggers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "properties": {
                        "type": _STR,
                        "name": _STR,
                        "useCachedMetrics": {"type": "boolean"},
                        "metricType": {"type": "string", "enum": ["AverageValue", "Value", "Utilization"]},
                        # KEDA reads every trigger setting as a string.
                        "metadata": {"type": "object", "additionalProperties": _STR},
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": _STR, "kind": _STR},
                        },
                    },
                },
            },
        },
    }
)

_PARENT_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "group": _STR,
        "kind": _STR,
        "namespace": _STR,
        "name": _STR,
        "sectionName": _STR,
        "port": _INT,
    },
}

_BACKEND_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "group": _STR,
        "kind": _STR,
        "name": _STR,
        "namespace": _STR,
        "port": _INT,
        "weight": _INT,
        "filters": {"type": "array", "items": _OPAQUE},
    },
}

_MATCH = {
    "type": "object",
    "properties": {
        "path": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": _STR,
            },
        },
        "headers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "value"],
                "properties": {
                    "type": {"type": "string", "enum": ["Exact", "RegularExpression"]},
                    "name": _STR,
                    "value": _STR,
                },
            },
        },
        "queryParams": {"type": "array", "items": _OPAQUE},
        "method": {
            "type": "string",
            "enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"],
        },
    },
}

HTTP_ROUTE: dict[str, Any] = _kind_schema(
    {
        "type": "object",
        "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": _STR},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": _STR,
                        "matches": {"type": "array", "maxItems": 64, "items": _MATCH},
                        "filters": {"type": "array", "items": _OPAQUE},
                        "backendRefs": {"type": "array", "items": _BACKEND_REF},
                        "timeouts": {
                            "type": "object",
                            "properties": {"request": _STR, "backendRequest": _STR},
                        },
                        "retry": _OPAQUE,
                        "sessionPersistence": _OPAQUE,
                    },
                },
            },
        },
    }
)

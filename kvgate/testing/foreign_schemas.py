"""OpenAPI schemas for the foreign kinds kvgate writes but does not define: KEDA's
ScaledObject (keda.sh/v1alpha1), Gateway API's HTTPRoute (gateway.networking.k8s.io/v1) and the
Prometheus Operator's PodMonitor, ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1).

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


# ---------------------------------------------------------------------------------------------
# Prometheus Operator (monitoring.coreos.com/v1), from its API reference: the chart's opt-in
# monitoring objects. Durations use the operator's pattern; TLS, OAuth2, basic auth and
# relabelling blocks are opaque (the chart writes none).
# ---------------------------------------------------------------------------------------------

_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STR_MAP = {"type": "object", "additionalProperties": _STR}
_SECRET_KEY = {
    "type": "object",
    "required": ["key"],
    "properties": {"name": _STR, "key": _STR, "optional": {"type": "boolean"}},
}
_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _STR_MAP,
        "matchExpressions": {"type": "array", "items": _OPAQUE},
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
}
_SCRAPE_ENDPOINT_COMMON = {
    "path": _STR,
    "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": {"type": "array", "items": _STR}},
    "interval": _DURATION,
    "scrapeTimeout": _DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "trackTimestampsStaleness": {"type": "boolean"},
    "authorization": {
        "type": "object",
        "properties": {"type": _STR, "credentials": _SECRET_KEY},
    },
    "bearerTokenSecret": _SECRET_KEY,
    "basicAuth": _OPAQUE,
    "oauth2": _OPAQUE,
    "tlsConfig": _OPAQUE,
    "metricRelabelings": {"type": "array", "items": _OPAQUE},
    "relabelings": {"type": "array", "items": _OPAQUE},
    "proxyUrl": _STR,
    "followRedirects": {"type": "boolean"},
    "enableHttp2": {"type": "boolean"},
    "filterRunning": {"type": "boolean"},
}
_INT_OR_STRING = {"x-kubernetes-int-or-string": True}
_MONITOR_COMMON = {
    "jobLabel": _STR,
    "podTargetLabels": {"type": "array", "items": _STR},
    "selector": _LABEL_SELECTOR,
    "namespaceSelector": _NAMESPACE_SELECTOR,
    "sampleLimit": {"type": "integer", "format": "int64"},
    "targetLimit": {"type": "integer", "format": "int64"},
    "labelLimit": {"type": "integer", "format": "int64"},
    "attachMetadata": _OPAQUE,
    "scrapeClass": _STR,
}

POD_MONITOR: dict[str, Any] = _kind_schema(
    {
        "type": "object",
        "required": ["selector"],
        "properties": {
            **_MONITOR_COMMON,
            "podMetricsEndpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        **_SCRAPE_ENDPOINT_COMMON,
                        "port": _STR,
                        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "targetPort": _INT_OR_STRING,
                    },
                },
            },
        },
    }
)

SERVICE_MONITOR: dict[str, Any] = _kind_schema(
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            **_MONITOR_COMMON,
            "targetLabels": {"type": "array", "items": _STR},
            "endpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        **_SCRAPE_ENDPOINT_COMMON,
                        "port": _STR,
                        "targetPort": _INT_OR_STRING,
                        "bearerTokenFile": _STR,
                    },
                },
            },
        },
    }
)

PROMETHEUS_RULE: dict[str, Any] = _kind_schema(
    {
        "type": "object",
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "query_offset": _DURATION,
                        "limit": {"type": "integer"},
                        "partial_response_strategy": _STR,
                        "labels": _STR_MAP,
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["expr"],
                                "properties": {
                                    "record": _STR,
                                    "alert": _STR,
                                    "expr": _INT_OR_STRING,
                                    "for": _DURATION,
                                    "keep_firing_for": _DURATION,
                                    "labels": _STR_MAP,
                                    "annotations": _STR_MAP,
                                },
                            },
                        },
                    },
                },
            },
        },
    }
)

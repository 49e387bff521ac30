"""InferencePool routing for Envoy Gateway: its extension server, and the pool status a gateway owes.

Envoy Gateway translates Gateway API objects into xDS and, for backendRef kinds it does not
know, hands the result to an extension server over gRPC (`envoygateway.extension`, its
``proto/extension``). Registered for ``inference.networking.k8s.io/InferencePool`` under
``extensionManager.backendResources``, this server makes each pool work as GIE defines it:

- ``PostClusterModify`` (a route's cluster for a pool): an ``ORIGINAL_DST`` cluster that
  connects to whatever ``x-gateway-destination-endpoint`` names, the header the pool's EPP
  sets; the pool rides along in the cluster's metadata, so later hooks need no memory.
- ``PostTranslateModify`` (everything, once per translation): for each pool, a cluster for its
  EPP (``<endpointPickerRef.name>.<namespace>.svc.cluster.local``, HTTP/2, TLS without
  verification as GIE's EPPs serve a self-signed certificate), an ext_proc filter in every HTTP
  listener, off by default and switched on only on the routes whose cluster is that pool's, with
  the GIE settings kvgate's own gateway uses (kvgate.gateway.envoy_config). Ahead of them, a
  header_mutation filter removes a client's ``x-gateway-destination-endpoint``: only the EPP
  names the endpoint (``use_http_header`` is unsanitised by Envoy: a forged value would
  send the request to any host and port the proxy can reach).
- ``FailOpen`` pools: an ``ORIGINAL_DST`` cluster cannot fail open (with the EPP gone no endpoint
  is named, and it connects to the listener's own address, the proxy itself). So a FailOpen
  pool's cluster is its endpoints instead, resolved through a headless "shadow" Service of the
  pool's selector (as Istio makes one per InferencePool; `PoolStatus` keeps it, owned by the
  pool), with Envoy's override-host policy: the EPP's pick when it named one, round robin over
  the pool's ready endpoints when no EPP answered (the ext_proc filter then lets the request
  through). A forged header can only name one of the pool's own endpoints there.

`PoolStatus` writes ``InferencePool.status.parents``, and keeps the FailOpen pools' shadow Services: one entry per Gateway of Envoy Gateway's
class whose accepted HTTPRoute sends to the pool, with ``Accepted`` and ``ResolvedRefs`` (the
EPP's Service exists). That is what makes ``kubectl get inferencepools`` say ACCEPTED True.

The messages are built at import from Envoy's descriptors (xds-protos) and this module's own
declaration of the extension's wire contract: no generated files, no protoc.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import envoy.config.cluster.v3.cluster_pb2 as cluster_pb2
import envoy.config.common.mutation_rules.v3.mutation_rules_pb2 as mutation_rules_pb2
import envoy.config.endpoint.v3.endpoint_pb2 as endpoint_pb2
import envoy.config.listener.v3.listener_pb2 as listener_pb2
import envoy.config.route.v3.route_components_pb2 as route_components_pb2
import envoy.config.route.v3.route_pb2 as route_pb2
import envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 as ext_proc_pb2
import envoy.extensions.filters.http.header_mutation.v3.header_mutation_pb2 as header_mutation_pb2
import envoy.extensions.filters.http.header_to_metadata.v3.header_to_metadata_pb2 as header_to_metadata_pb2
import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 as hcm_pb2
import envoy.extensions.transport_sockets.tls.v3.secret_pb2 as secret_pb2
import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2 as http_options_pb2
import grpc
import httpx
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import Message

from kvgate.gateway.envoy_config import _any, _ext_proc_filter, _grpc_cluster, _override_host_cluster

log = logging.getLogger("kvgate.gateway.extension")

POOL_GROUP = "inference.networking.k8s.io"
POOL_KIND = "InferencePool"
ENDPOINT_HEADER = "x-gateway-destination-endpoint"
METADATA_KEY = "kvgate.dev/inference-pool"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
STRIP_FILTER = "envoy.filters.http.header_mutation/kvgate/strip-destination-endpoint"
SERVED_FILTER = "envoy.filters.http.header_to_metadata/kvgate/destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
EG_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
DEFAULT_EPP_PORT = 9002
MESSAGE_TIMEOUT = 300.0  # seconds: a long prompt's whole body is buffered before the pick
SERVICE = "envoygateway.extension.EnvoyGatewayExtension"

# -- the wire contract --------------------------------------------------------------------------
# (message, [(field, number, type, repeated)]): a type starting with "." is a message.
_DEPENDENCIES = [cluster_pb2, endpoint_pb2, listener_pb2, route_components_pb2, route_pb2, secret_pb2]
_MESSAGES: list[tuple[str, list[tuple[str, int, str, bool]]]] = [
    ("ExtensionResource", [("unstructured_bytes", 1, "bytes", False)]),
    (
        "PostRouteExtensionContext",
        [
            ("extension_resources", 1, ".envoygateway.extension.ExtensionResource", True),
            ("hostnames", 2, "string", True),
            ("extension_policies", 3, ".envoygateway.extension.ExtensionResource", True),
        ],
    ),
    ("PostVirtualHostExtensionContext", []),
    (
        "PostClusterExtensionContext",
        [("backend_extension_resources", 1, ".envoygateway.extension.ExtensionResource", True)],
    ),
    ("PostEndpointsExtensionContext", []),
    (
        "PostHTTPListenerExtensionContext",
        [("extension_resources", 1, ".envoygateway.extension.ExtensionResource", True)],
    ),
    (
        "PostTranslateExtensionContext",
        [("extension_resources", 1, ".envoygateway.extension.ExtensionResource", True)],
    ),
    (
        "PostRouteModifyRequest",
        [
            ("route", 1, ".envoy.config.route.v3.Route", False),
            ("post_route_context", 2, ".envoygateway.extension.PostRouteExtensionContext", False),
        ],
    ),
    ("PostRouteModifyResponse", [("route", 1, ".envoy.config.route.v3.Route", False)]),
    (
        "PostClusterModifyRequest",
        [
            ("cluster", 1, ".envoy.config.cluster.v3.Cluster", False),
            ("post_cluster_context", 2, ".envoygateway.extension.PostClusterExtensionContext", False),
        ],
    ),
    ("PostClusterModifyResponse", [("cluster", 1, ".envoy.config.cluster.v3.Cluster", False)]),
    (
        "PostEndpointsModifyRequest",
        [
            ("load_assignment", 1, ".envoy.config.endpoint.v3.ClusterLoadAssignment", False),
            ("post_endpoints_context", 2, ".envoygateway.extension.PostEndpointsExtensionContext", False),
        ],
    ),
    (
        "PostEndpointsModifyResponse",
        [("load_assignment", 1, ".envoy.config.endpoint.v3.ClusterLoadAssignment", False)],
    ),
    (
        "PostVirtualHostModifyRequest",
        [
            ("virtual_host", 1, ".envoy.config.route.v3.VirtualHost", False),
            (
                "post_virtual_host_context",
                2,
                ".envoygateway.extension.PostVirtualHostExtensionContext",
                False,
            ),
        ],
    ),
    ("PostVirtualHostModifyResponse", [("virtual_host", 1, ".envoy.config.route.v3.VirtualHost", False)]),
    (
        "PostHTTPListenerModifyRequest",
        [
            ("listener", 1, ".envoy.config.listener.v3.Listener", False),
            ("post_listener_context", 2, ".envoygateway.extension.PostHTTPListenerExtensionContext", False),
        ],
    ),
    ("PostHTTPListenerModifyResponse", [("listener", 1, ".envoy.config.listener.v3.Listener", False)]),
    (
        "PostTranslateModifyRequest",
        [
            ("post_translate_context", 1, ".envoygateway.extension.PostTranslateExtensionContext", False),
            ("clusters", 2, ".envoy.config.cluster.v3.Cluster", True),
            ("secrets", 3, ".envoy.extensions.transport_sockets.tls.v3.Secret", True),
            ("listeners", 4, ".envoy.config.listener.v3.Listener", True),
            ("routes", 5, ".envoy.config.route.v3.RouteConfiguration", True),
        ],
    ),
    (
        "PostTranslateModifyResponse",
        [
            ("clusters", 1, ".envoy.config.cluster.v3.Cluster", True),
            ("secrets", 2, ".envoy.extensions.transport_sockets.tls.v3.Secret", True),
            ("listeners", 3, ".envoy.config.listener.v3.Listener", True),
            ("routes", 4, ".envoy.config.route.v3.RouteConfiguration", True),
        ],
    ),
]
_SCALARS = {
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
}


def _build_messages() -> dict[str, type[Message]]:
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="kvgate/envoygateway_extension.proto",
        package="envoygateway.extension",
        syntax="proto3",
        dependency=[m.DESCRIPTOR.name for m in _DEPENDENCIES],
    )
    for name, fields in _MESSAGES:
        msg = file.message_type.add(name=name)
        for field, number, kind, repeated in fields:
            f = msg.field.add(
                name=field,
                number=number,
                label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL,
            )
            if kind.startswith("."):
                f.type, f.type_name = F.TYPE_MESSAGE, kind
            else:
                f.type = _SCALARS[kind]
    pool = descriptor_pool.Default()
    try:
        described = pool.FindFileByName(file.name)
    except KeyError:
        described = pool.Add(file)
    return {
        name: message_factory.GetMessageClass(described.message_types_by_name[name]) for name, _ in _MESSAGES
    }


MESSAGES = _build_messages()


# -- what a pool asks of the gateway ------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    namespace: str
    name: str
    epp: str
    epp_port: int
    failure_mode: str  # FailOpen | FailClose
    app_protocol: str = "http"  # of the target ports: http (HTTP/1.1) or kubernetes.io/h2c
    target_port: int = 0  # the endpoints' port (spec.targetPorts[0]); 0: not known

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Pool:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        ref = spec.get("endpointPickerRef") or {}
        port = (ref.get("port") or {}).get("number") or DEFAULT_EPP_PORT
        return cls(
            namespace=str(meta.get("namespace") or "default"),
            name=str(meta["name"]),
            epp=str(ref["name"]),
            epp_port=int(port),
            failure_mode=str(ref.get("failureMode") or "FailClose"),
            app_protocol=str(spec.get("appProtocol") or "http"),
            target_port=int(((spec.get("targetPorts") or [{}])[0] or {}).get("number") or 0),
        )

    @property
    def fails_open(self) -> bool:
        """FailOpen with a port to reach its endpoints on (its cluster is then those endpoints)."""
        return self.failure_mode == "FailOpen" and self.target_port > 0

    @property
    def shadow_service(self) -> str:
        """The headless Service of the pool's endpoints (a DNS label: the pool's name, which may
        hold dots, trimmed, and a hash of namespace/name so two pools never share one)."""
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:8]
        stem = re.sub(r"[^a-z0-9-]", "-", self.name.lower())[:50].strip("-") or "pool"
        return f"{'p-' if stem[0].isdigit() else ''}{stem}-ip-{digest}"

    @property
    def shadow_host(self) -> str:
        return f"{self.shadow_service}.{self.namespace}.svc.cluster.local"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def epp_cluster(self) -> str:
        return f"kvgate/epp/{self.namespace}/{self.name}"

    @property
    def filter_name(self) -> str:
        return f"envoy.filters.http.ext_proc/kvgate/{self.namespace}/{self.name}"

    @property
    def epp_host(self) -> str:
        return f"{self.epp}.{self.namespace}.svc.cluster.local"

    def as_struct(self) -> struct_pb2.Struct:
        s = struct_pb2.Struct()
        s.update(
            {
                "namespace": self.namespace,
                "name": self.name,
                "epp": self.epp,
                "eppPort": self.epp_port,
                "failureMode": self.failure_mode,
                "appProtocol": self.app_protocol,
                "targetPort": self.target_port,
            }
        )
        return s

    @classmethod
    def from_cluster(cls, cluster: cluster_pb2.Cluster) -> Pool | None:
        meta = cluster.metadata.filter_metadata.get(METADATA_KEY)
        if meta is None:
            return None
        return cls.from_struct(dict(meta))

    @classmethod
    def from_struct(cls, d: dict[str, Any]) -> Pool:
        return cls(
            d["namespace"],
            d["name"],
            d["epp"],
            int(d["eppPort"]),
            d["failureMode"],
            d.get("appProtocol", "http"),
            int(d.get("targetPort") or 0),
        )


def pools_of(resources: list[Any]) -> list[Pool | None]:
    """A hook's extension resources (unstructured JSON) in order, as pools (None: another kind)."""
    out: list[Pool | None] = []
    for res in resources:
        try:
            obj = json.loads(res.unstructured_bytes)
        except ValueError:
            obj = {}
        pool = obj.get("kind") == POOL_KIND and str(obj.get("apiVersion", "")).startswith(POOL_GROUP + "/")
        out.append(Pool.from_object(obj) if pool else None)
    return out


# The rule's cluster Envoy Gateway names after the route: httproute/<namespace>/<name>/rule/<index>
RULE_CLUSTER = re.compile(r"^httproute/(?P<namespace>[^/]+)/(?P<name>[^/]+)/rule/(?P<rule>\d+)$")
# (namespace, HTTPRoute name, rule index) -> that rule's backendRefs as the API server has them
# (None: unknown)
RuleBackendRefs = Callable[[str, str, int], "list[dict[str, Any]] | None"]


def split_of(
    cluster_name: str, pools: list[Pool | None], backend_refs: RuleBackendRefs
) -> list[tuple[Pool, int]]:
    """A rule's backendRefs to several pools, with their weights. Envoy Gateway makes one cluster
    for the rule and hands the hook the rule's custom backends (the pools) but not their weights,
    which live only in its EDS localities (v1.9: internal/xds/translator/cluster.go), a resource
    this hook never sees; so they are read from the HTTPRoute itself. [] unless every backendRef
    of the rule with a weight is one of the pools given, and there are two or more."""
    match = RULE_CLUSTER.match(cluster_name)
    given = {p.key: p for p in pools if p is not None}
    if match is None or len(given) < 2:
        return []
    namespace = match["namespace"]
    refs = backend_refs(namespace, match["name"], int(match["rule"]))
    if not refs:
        return []
    found: list[tuple[Pool, int]] = []
    for ref in refs:
        weight = int(ref.get("weight", 1))
        if weight == 0:  # Gateway API: no traffic (and Envoy Gateway leaves it out)
            continue
        if ref.get("kind") != POOL_KIND or ref.get("group") != POOL_GROUP:
            return []
        pool = given.get(f"{ref.get('namespace') or namespace}/{ref.get('name')}")
        if pool is None:
            return []
        found.append((pool, weight))
    return found if len({p.key for p, _ in found}) > 1 else []


# -- the hooks ----------------------------------------------------------------------------------
SPLIT_KEY = "kvgate.dev/inference-pool-split"
H2C_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def pool_cluster(
    cluster: cluster_pb2.Cluster, pool: Pool, split: list[tuple[Pool, int]] | None = None
) -> cluster_pb2.Cluster:
    """The route's cluster for a pool: connect to the endpoint the EPP named. A rule split
    between pools keeps the split in the metadata; the translation hook then gives each pool a
    cluster of its own and the route a weighted choice between them."""
    out = cluster_pb2.Cluster()
    out.CopyFrom(cluster)
    _to_destination(out, pool)
    if pool.app_protocol == "kubernetes.io/h2c":  # GIE: the model servers speak HTTP/2 cleartext
        out.typed_extension_protocol_options[H2C_OPTIONS].CopyFrom(_h2c())
    out.metadata.filter_metadata[METADATA_KEY].CopyFrom(pool.as_struct())
    if split:
        entries = struct_pb2.Struct()
        entries.update({"pools": [{**dict(p.as_struct()), "weight": w} for p, w in split]})
        out.metadata.filter_metadata[SPLIT_KEY].CopyFrom(entries)
    return out


def _to_destination(out: cluster_pb2.Cluster, pool: Pool) -> None:
    """In place: the cluster reaches the endpoint the pool's EPP names. FailClose: an
    ORIGINAL_DST cluster on the EPP's header (any pod, at once). FailOpen: the pool's endpoints
    by DNS (its shadow Service) under the override-host policy, which also serves a request no
    EPP saw, round robin. Envoy Gateway's other settings on the cluster (timeouts, circuit
    breakers, TLS) stay."""
    for name in (
        "load_assignment",
        "eds_cluster_config",
        "load_balancing_policy",
        "health_checks",
        "lb_policy",
        "original_dst_lb_config",
        "dns_refresh_rate",
        "dns_lookup_family",
        "outlier_detection",
    ):
        out.ClearField(name)
    if pool.fails_open:
        endpoints = _override_host_cluster([(pool.shadow_host, pool.target_port)], by_dns=True, name=out.name)
        for name in ("type", "dns_lookup_family"):
            setattr(out, name, getattr(endpoints, name))
        for name in ("dns_refresh_rate", "load_assignment", "load_balancing_policy", "outlier_detection"):
            getattr(out, name).CopyFrom(getattr(endpoints, name))
        return
    out.type = cluster_pb2.Cluster.ORIGINAL_DST
    out.lb_policy = cluster_pb2.Cluster.CLUSTER_PROVIDED
    out.original_dst_lb_config.use_http_header = True
    out.original_dst_lb_config.http_header_name = ENDPOINT_HEADER


def shadow_service(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The headless Service a FailOpen InferencePool's cluster resolves its endpoints through
    (its selector, its target port, owned by the pool so it goes with it); None for another pool,
    and for one too malformed to route (no endpointPickerRef name: its status says so)."""
    try:
        pool = Pool.from_object(obj)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    selector = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    meta = obj.get("metadata") or {}
    if not pool.fails_open or not selector or not meta.get("uid"):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": pool.shadow_service,
            "namespace": pool.namespace,
            "labels": {METADATA_KEY: pool.name, "app.kubernetes.io/managed-by": "kvgate-gateway-extension"},
            "ownerReferences": [
                {
                    "apiVersion": str(obj.get("apiVersion") or f"{POOL_GROUP}/v1"),
                    "kind": POOL_KIND,
                    "name": pool.name,
                    "uid": meta["uid"],
                }
            ],
        },
        "spec": {
            "clusterIP": "None",
            "selector": dict(selector),
            "ports": [{"name": "http", "port": pool.target_port, "targetPort": pool.target_port}],
            "publishNotReadyAddresses": False,
        },
    }


def _h2c() -> Any:
    options = http_options_pb2.HttpProtocolOptions()
    options.explicit_http_config.http2_protocol_options.SetInParent()
    return _any(options)


def _split_clusters(cluster: cluster_pb2.Cluster) -> list[tuple[cluster_pb2.Cluster, Pool, int]]:
    """For a split rule's cluster: one cluster per pool (named after the rule's cluster and the
    pool), with its weight; [] for a cluster of one pool."""
    meta = cluster.metadata.filter_metadata.get(SPLIT_KEY)
    if meta is None:
        return []
    out = []
    for entry in meta.fields["pools"].list_value.values:
        d = dict(entry.struct_value)
        pool = Pool.from_struct(d)
        one = cluster_pb2.Cluster()
        one.CopyFrom(cluster)
        one.name = f"{cluster.name}/pool/{pool.key}"
        del one.metadata.filter_metadata[SPLIT_KEY]
        _to_destination(one, pool)
        one.metadata.filter_metadata[METADATA_KEY].CopyFrom(pool.as_struct())
        if H2C_OPTIONS in one.typed_extension_protocol_options:
            del one.typed_extension_protocol_options[H2C_OPTIONS]
        if pool.app_protocol == "kubernetes.io/h2c":
            one.typed_extension_protocol_options[H2C_OPTIONS].CopyFrom(_h2c())
        out.append((one, pool, int(d["weight"])))
    return out


def _route_clusters(route: route_components_pb2.Route) -> list[str]:
    action = route.route
    if action.cluster:
        return [action.cluster]
    return [c.name for c in action.weighted_clusters.clusters]


def translate(
    clusters: list[cluster_pb2.Cluster],
    listeners: list[listener_pb2.Listener],
    routes: list[route_pb2.RouteConfiguration],
) -> tuple[list[cluster_pb2.Cluster], list[listener_pb2.Listener], list[route_pb2.RouteConfiguration]]:
    """Add each pool's EPP cluster and ext_proc filter, and switch the filter on for its routes."""
    splits = {c.name: _split_clusters(c) for c in clusters}
    splits = {name: parts for name, parts in splits.items() if parts}
    have_names = {c.name for c in clusters}
    clusters = list(clusters) + [
        one for parts in splits.values() for one, _, _ in parts if one.name not in have_names
    ]
    pools: dict[str, Pool] = {}
    for c in clusters:
        pool = Pool.from_cluster(c)
        if pool is not None:
            pools[c.name] = pool
    if not pools:
        return clusters, listeners, routes
    unique = {p.key: p for p in pools.values()}
    for pool in unique.values():
        if pool.failure_mode == "FailOpen" and not pool.fails_open:
            log.warning(
                "InferencePool %s: failureMode FailOpen without a target port is served as FailClose "
                "(no endpoints to fall back on)",
                pool.key,
            )
    have = {c.name for c in clusters}
    clusters = list(clusters)
    for pool in unique.values():
        if pool.epp_cluster not in have:
            clusters.append(_grpc_cluster(pool.epp_cluster, [(pool.epp_host, pool.epp_port)], False, True))
    # only the HTTP listeners whose route table sends somewhere to a pool get the filters
    tables = {
        config.name
        for config in routes
        if any(c in pools for vhost in config.virtual_hosts for r in vhost.routes for c in _route_clusters(r))
    }
    listeners = [_with_filters(listener, list(unique.values()), tables) for listener in listeners]
    routes = [_with_routes(config, pools, splits) for config in routes]
    return clusters, listeners, routes


def _strip_filter() -> hcm_pb2.HttpFilter:
    """Removes the client's x-gateway-destination-endpoint before any EPP runs."""
    remove = mutation_rules_pb2.HeaderMutation(remove=ENDPOINT_HEADER)
    config = header_mutation_pb2.HeaderMutation(
        mutations=header_mutation_pb2.Mutations(request_mutations=[remove])
    )
    return hcm_pb2.HttpFilter(name=STRIP_FILTER, typed_config=_any(config))


def _served_filter() -> hcm_pb2.HttpFilter:
    """GIE: the data plane tells the EPP, in the response phase's metadata, which endpoint
    served the request. An ORIGINAL_DST cluster connects to exactly the address the EPP's
    header names, so after the EPP (this filter runs after every ext_proc filter) that header
    is the served endpoint; the ext_proc filters forward ``envoy.lb`` with the response headers."""
    rule = header_to_metadata_pb2.Config.Rule(
        header=ENDPOINT_HEADER,
        on_header_present=header_to_metadata_pb2.Config.KeyValuePair(
            metadata_namespace=LB_NAMESPACE, key=SERVED_KEY, type=header_to_metadata_pb2.Config.STRING
        ),
    )
    return hcm_pb2.HttpFilter(
        name=SERVED_FILTER, typed_config=_any(header_to_metadata_pb2.Config(request_rules=[rule]))
    )


def _pool_ext_proc(pool: Pool) -> ext_proc_pb2.ExternalProcessor:
    """The pool's ext_proc filter: kvgate's gateway settings, plus the response headers (not
    the body) with ``envoy.lb`` forwarded, so the EPP learns the served endpoint (GIE)."""
    mode = "FailOpen" if pool.fails_open else "FailClose"
    config = _ext_proc_filter(mode, MESSAGE_TIMEOUT, False, pool.epp_cluster)
    config.processing_mode.response_header_mode = config.processing_mode.SEND
    config.metadata_options.forwarding_namespaces.untyped.append(LB_NAMESPACE)
    return config


def _with_filters(
    listener: listener_pb2.Listener, pools: list[Pool], tables: set[str]
) -> listener_pb2.Listener:
    out = listener_pb2.Listener()
    out.CopyFrom(listener)
    chains = [*out.filter_chains]
    if out.HasField("default_filter_chain"):
        chains.append(out.default_filter_chain)
    for chain in chains:
        for f in chain.filters:
            if f.name != HCM or not f.HasField("typed_config"):
                continue
            hcm = hcm_pb2.HttpConnectionManager()
            if not f.typed_config.Unpack(hcm) or hcm.rds.route_config_name not in tables:
                continue
            present = {h.name for h in hcm.http_filters}
            added = [_strip_filter()] if STRIP_FILTER not in present else []
            added += [
                hcm_pb2.HttpFilter(
                    name=p.filter_name,
                    typed_config=_any(_pool_ext_proc(p)),
                    disabled=True,  # on only where a route sends to this pool
                )
                for p in pools
                if p.filter_name not in present
            ]
            if added and SERVED_FILTER not in present:
                added.append(_served_filter())
            if not added:
                continue
            kept = list(hcm.http_filters)
            at = next((i for i, h in enumerate(kept) if h.name == ROUTER), len(kept))
            del hcm.http_filters[:]
            hcm.http_filters.extend([*kept[:at], *added, *kept[at:]])
            f.typed_config.CopyFrom(_any(hcm))
    return out


def _enabled() -> Any:
    """Per-route (or per weighted cluster) config that switches a disabled ext_proc filter on."""
    per_route = ext_proc_pb2.ExtProcPerRoute(overrides=ext_proc_pb2.ExtProcOverrides())
    return _any(route_components_pb2.FilterConfig(config=_any(per_route)))


def _with_routes(
    config: route_pb2.RouteConfiguration,
    pools: dict[str, Pool],
    splits: dict[str, list[tuple[cluster_pb2.Cluster, Pool, int]]] | None = None,
) -> route_pb2.RouteConfiguration:
    out = route_pb2.RouteConfiguration()
    out.CopyFrom(config)
    for vhost in out.virtual_hosts:
        for route in vhost.routes:
            split = (splits or {}).get(route.route.cluster) if route.HasField("route") else None
            if split:
                # A weighted choice between the pools' clusters, made when the route is chosen,
                # and only the chosen pool's EPP runs (its filter is on for that cluster alone):
                # the EPP of one pool never names an endpoint for the other's cluster.
                route.route.ClearField("cluster")
                for one, pool, weight in split:
                    entry = route.route.weighted_clusters.clusters.add(name=one.name)
                    entry.weight.value = weight
                    entry.typed_per_filter_config[pool.filter_name].CopyFrom(_enabled())
                continue
            if route.HasField("route") and route.route.HasField("weighted_clusters"):
                # each pool's EPP on for its own weighted cluster only
                for entry in route.route.weighted_clusters.clusters:
                    if entry.name in pools:
                        entry.typed_per_filter_config[pools[entry.name].filter_name].CopyFrom(_enabled())
                continue
            targets = {pools[c].filter_name for c in _route_clusters(route) if c in pools}
            for name in sorted(targets):
                route.typed_per_filter_config[name].CopyFrom(_enabled())
    return out


def _no_routes(namespace: str, name: str, rule: int) -> list[dict[str, Any]] | None:
    return None


class Extension:
    """The gRPC methods; a hook this server does not change answers with what it was given.
    ``backend_refs`` reads a rule's backendRefs (their weights) from the API server."""

    def __init__(self, backend_refs: RuleBackendRefs = _no_routes) -> None:
        self.backend_refs = backend_refs

    def post_cluster_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        resp = MESSAGES["PostClusterModifyResponse"]()
        found = pools_of(list(req.post_cluster_context.backend_extension_resources))
        pool = next((p for p in found if p is not None), None)
        if pool is None:
            resp.cluster.CopyFrom(req.cluster)
        else:
            split = split_of(req.cluster.name, found, self.backend_refs)
            if split:
                log.info(
                    "cluster %s: split %s", req.cluster.name, ", ".join(f"{p.key}={w}" for p, w in split)
                )
            resp.cluster.CopyFrom(pool_cluster(req.cluster, pool, split))
            log.info(
                "cluster %s -> InferencePool %s (EPP %s:%d)",
                req.cluster.name,
                pool.key,
                pool.epp_host,
                pool.epp_port,
            )
        return resp

    def post_translate_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        clusters, listeners, routes = translate(list(req.clusters), list(req.listeners), list(req.routes))
        resp = MESSAGES["PostTranslateModifyResponse"]()
        resp.clusters.extend(clusters)
        resp.secrets.extend(req.secrets)
        resp.listeners.extend(listeners)
        resp.routes.extend(routes)
        return resp

    def post_route_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return MESSAGES["PostRouteModifyResponse"](route=req.route)

    def post_virtual_host_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return MESSAGES["PostVirtualHostModifyResponse"](virtual_host=req.virtual_host)

    def post_http_listener_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return MESSAGES["PostHTTPListenerModifyResponse"](listener=req.listener)

    def post_endpoints_modify(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return MESSAGES["PostEndpointsModifyResponse"](load_assignment=req.load_assignment)

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any, grpc.ServicerContext], Any], request: str) -> grpc.RpcMethodHandler:
            def safe(req: Any, ctx: grpc.ServicerContext) -> Any:
                try:
                    return fn(req, ctx)
                except Exception as exc:  # a bad pool object must not take the gateway's xDS down
                    log.exception("%s failed: %s", fn.__name__, exc)
                    ctx.abort(grpc.StatusCode.INTERNAL, f"kvgate extension: {exc}")

            return grpc.unary_unary_rpc_method_handler(
                safe,
                request_deserializer=MESSAGES[request].FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "PostClusterModify": unary(self.post_cluster_modify, "PostClusterModifyRequest"),
                "PostTranslateModify": unary(self.post_translate_modify, "PostTranslateModifyRequest"),
                "PostRouteModify": unary(self.post_route_modify, "PostRouteModifyRequest"),
                "PostVirtualHostModify": unary(self.post_virtual_host_modify, "PostVirtualHostModifyRequest"),
                "PostHTTPListenerModify": unary(
                    self.post_http_listener_modify, "PostHTTPListenerModifyRequest"
                ),
                "PostEndpointsModify": unary(self.post_endpoints_modify, "PostEndpointsModifyRequest"),
            },
        )


# -- InferencePool status -------------------------------------------------------------------------
def _condition(kind: str, ok: bool, reason: str, message: str, generation: int, since: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def route_accepted_by(route: dict[str, Any], gateway: tuple[str, str]) -> bool:
    for parent in (route.get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        ns = ref.get("namespace") or route["metadata"]["namespace"]
        if (ns, ref.get("name")) != gateway or parent.get("controllerName") != EG_CONTROLLER:
            continue
        return any(
            c.get("type") == "Accepted" and c.get("status") == "True" for c in parent.get("conditions") or []
        )
    return False


def pool_parents(
    pool: dict[str, Any],
    routes: list[dict[str, Any]],
    gateways: dict[tuple[str, str], dict[str, Any]],
    classes: dict[str, dict[str, Any]],
    services: set[tuple[str, str]],
    now: str,
) -> list[dict[str, Any]]:
    """status.parents of one pool: each Envoy Gateway Gateway with an accepted route to it."""
    ns, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
    generation = int(pool["metadata"].get("generation") or 1)
    old = {
        ((p.get("parentRef") or {}).get("namespace"), (p.get("parentRef") or {}).get("name")): p
        for p in (pool.get("status") or {}).get("parents") or []
    }
    try:
        epp = Pool.from_object(pool).epp
    except (KeyError, TypeError, ValueError):
        epp = ""
    parents: dict[tuple[str, str], dict[str, Any]] = {}
    for route in routes:
        rns = route["metadata"]["namespace"]
        to_pool = any(
            b.get("group") == POOL_GROUP and b.get("kind") == POOL_KIND and b.get("name") == name
            and (b.get("namespace") or rns) == ns
            for rule in (route.get("spec") or {}).get("rules") or []
            for b in rule.get("backendRefs") or []
        )  # fmt: skip
        if not to_pool:
            continue
        for ref in (route.get("spec") or {}).get("parentRefs") or []:
            if ref.get("kind", "Gateway") != "Gateway":
                continue
            key = (ref.get("namespace") or rns, ref["name"])
            gateway = gateways.get(key)
            if gateway is None:
                continue
            gclass = classes.get(gateway["spec"].get("gatewayClassName", ""))
            if gclass is None or gclass["spec"].get("controllerName") != EG_CONTROLLER:
                continue
            accepted = route_accepted_by(route, key)
            resolved = (ns, epp) in services
            previous = {c["type"]: c for c in (old.get(key) or {}).get("conditions") or []}

            def since(kind: str, ok: bool, previous: dict[str, Any] = previous) -> str:
                before = previous.get(kind)
                return (
                    before["lastTransitionTime"]
                    if before and before["status"] == ("True" if ok else "False")
                    else now
                )

            parents[key] = {
                "parentRef": {
                    "group": "gateway.networking.k8s.io",
                    "kind": "Gateway",
                    "namespace": key[0],
                    "name": key[1],
                },
                "controllerName": EG_CONTROLLER,
                "conditions": [
                    _condition(
                        "Accepted",
                        accepted,
                        "Accepted" if accepted else "HTTPRouteNotAccepted",
                        "an HTTPRoute through this Gateway sends to the pool"
                        if accepted
                        else "the Gateway has not accepted the HTTPRoute that sends to the pool",
                        generation,
                        since("Accepted", accepted),
                    ),
                    _condition(
                        "ResolvedRefs",
                        resolved,
                        "ResolvedRefs" if resolved else "InvalidExtensionRef",
                        f"endpoint picker Service {ns}/{epp}" + (" found" if resolved else " not found"),
                        generation,
                        since("ResolvedRefs", resolved),
                    ),
                ],
            }
    return [parents[k] for k in sorted(parents)]


class PoolStatus:
    """Keeps every InferencePool's status.parents true, by polling (a small cluster)."""

    def __init__(self, api: httpx.AsyncClient, period: float = 2.0) -> None:
        self.api, self.period = api, period
        self._loop: asyncio.AbstractEventLoop | None = None

    def rule_backend_refs(self, namespace: str, name: str, rule: int) -> list[dict[str, Any]] | None:
        """An HTTPRoute rule's backendRefs, read now (the extension's hooks run in gRPC threads;
        the API client lives on this object's loop). None when it cannot be read."""
        loop = self._loop
        if loop is None:
            return None
        path = f"/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/httproutes/{name}"
        try:
            resp = asyncio.run_coroutine_threadsafe(self.api.get(path), loop).result(timeout=10)
            if resp.status_code != 200:
                return None
            rules = (resp.json().get("spec") or {}).get("rules") or []
            return list(rules[rule].get("backendRefs") or []) if rule < len(rules) else None
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.warning("HTTPRoute %s/%s not read for its weights: %s", namespace, name, exc)
            return None

    async def _items(self, path: str) -> list[dict[str, Any]]:
        resp = await self.api.get(path)
        if resp.status_code == 404:  # the CRD is not installed (yet)
            return []
        resp.raise_for_status()
        return list(resp.json().get("items") or [])

    async def sync(self) -> None:
        pools = await self._items(f"/apis/{POOL_GROUP}/v1/inferencepools")
        if not pools:
            return
        routes = await self._items("/apis/gateway.networking.k8s.io/v1/httproutes")
        gateways = {
            (g["metadata"]["namespace"], g["metadata"]["name"]): g
            for g in await self._items("/apis/gateway.networking.k8s.io/v1/gateways")
        }
        classes = {
            c["metadata"]["name"]: c
            for c in await self._items("/apis/gateway.networking.k8s.io/v1/gatewayclasses")
        }
        service_objects = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s
            for s in await self._items("/api/v1/services")
        }
        services = set(service_objects)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pool in pools:
            await self._keep_shadow(pool, service_objects)
            parents = pool_parents(pool, routes, gateways, classes, services, now)
            if parents == ((pool.get("status") or {}).get("parents") or []):
                continue
            meta = pool["metadata"]
            resp = await self.api.patch(
                f"/apis/{POOL_GROUP}/v1/namespaces/{meta['namespace']}/inferencepools/{meta['name']}/status",
                content=json.dumps({"status": {"parents": parents}}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
            if resp.status_code >= 400:
                log.warning(
                    "InferencePool %s/%s status: %s %s",
                    meta["namespace"],
                    meta["name"],
                    resp.status_code,
                    resp.text[:300],
                )
            else:
                log.info(
                    "InferencePool %s/%s: parents %s",
                    meta["namespace"],
                    meta["name"],
                    [p["parentRef"]["name"] for p in parents],
                )

    async def _keep_shadow(
        self, pool: dict[str, Any], services: dict[tuple[str, str], dict[str, Any]]
    ) -> None:
        """A FailOpen pool's shadow Service: made when missing, its selector and ports put back
        when they drifted from the pool's."""
        want = shadow_service(pool)
        if want is None:
            return
        ns, name = want["metadata"]["namespace"], want["metadata"]["name"]
        have = services.get((ns, name))
        if have is None:
            resp = await self.api.post(f"/api/v1/namespaces/{ns}/services", json=want)
            what = "made"
        elif {k: (have.get("spec") or {}).get(k) for k in ("selector", "ports")} != {
            "selector": want["spec"]["selector"],
            "ports": [{**want["spec"]["ports"][0], "protocol": "TCP"}],
        }:
            patch = {"spec": {k: want["spec"][k] for k in ("selector", "ports")}}
            resp = await self.api.patch(
                f"/api/v1/namespaces/{ns}/services/{name}",
                content=json.dumps(patch),
                headers={"Content-Type": "application/merge-patch+json"},
            )
            what = "updated"
        else:
            return
        if resp.status_code >= 400 and resp.status_code != 409:  # 409: made meanwhile
            log.warning("InferencePool %s/%s: shadow Service %s: %s %s", ns, pool["metadata"]["name"], name,
                        resp.status_code, resp.text[:300])  # fmt: skip
        else:
            log.info("InferencePool %s/%s: shadow Service %s %s", ns, pool["metadata"]["name"], name, what)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                await self.sync()
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("InferencePool status sync failed: %s", exc)
            await asyncio.sleep(self.period)

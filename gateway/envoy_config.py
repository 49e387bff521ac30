"""A standalone Envoy bootstrap for the EPP, built from Envoy's typed protos (never templates).

Listener → HTTP connection manager → ext_proc filter (GIE settings: full-duplex streamed
bodies, header/trailer modes SEND) → router. Requests the EPP routed carry
``x-gateway-destination-endpoint`` and go to an ``ORIGINAL_DST`` cluster that connects to
exactly that ip:port. With FailOpen and a fallback endpoint list, requests that the EPP could
not see (it is down) go round-robin to the pool instead. An optional direct route (header
``x-kvgate-route: direct``) skips ext_proc entirely: the latency baseline.

One ``GatewaySpec`` describes a bootstrap: its pools (one, ``GatewaySpec.one_pool``; or several,
each named, behind the model router, ``kvgate router serve``) and the listener's settings. A
single pool is the several-pools path with one unnamed pool: ``_routes``, ``_listener`` and
``_clusters`` build each part for every pool alike.

``python -m kvgate.gateway.envoy_config --help`` prints the bootstrap as YAML.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import envoy.config.accesslog.v3.accesslog_pb2 as accesslog_pb2
import envoy.config.bootstrap.v3.bootstrap_pb2 as bootstrap_pb2
import envoy.config.cluster.v3.circuit_breaker_pb2 as circuit_breaker_pb2
import envoy.config.cluster.v3.cluster_pb2 as cluster_pb2
import envoy.config.cluster.v3.outlier_detection_pb2 as outlier_detection_pb2
import envoy.config.core.v3.address_pb2 as address_pb2
import envoy.config.core.v3.base_pb2 as base_pb2
import envoy.config.core.v3.config_source_pb2  # noqa: F401  (registers types MessageToDict may meet)
import envoy.config.core.v3.extension_pb2 as extension_pb2
import envoy.config.core.v3.grpc_service_pb2 as grpc_service_pb2
import envoy.config.core.v3.health_check_pb2 as health_check_pb2
import envoy.config.core.v3.protocol_pb2 as protocol_pb2
import envoy.config.core.v3.substitution_format_string_pb2 as substitution_pb2
import envoy.config.endpoint.v3.endpoint_components_pb2 as endpoint_components_pb2
import envoy.config.endpoint.v3.endpoint_pb2 as endpoint_pb2
import envoy.config.listener.v3.listener_components_pb2 as listener_components_pb2
import envoy.config.listener.v3.listener_pb2 as listener_pb2
import envoy.config.route.v3.route_components_pb2 as route_components_pb2
import envoy.config.route.v3.route_pb2 as route_pb2
import envoy.extensions.access_loggers.filters.cel.v3.cel_pb2 as cel_pb2
import envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 as ext_proc_pb2
import envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 as processing_mode_pb2
import envoy.extensions.filters.http.router.v3.router_pb2 as router_pb2
import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 as hcm_pb2
import envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2 as override_host_pb2
import envoy.extensions.load_balancing_policies.round_robin.v3.round_robin_pb2 as round_robin_pb2
import envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2 as previous_hosts_pb2
import envoy.extensions.transport_sockets.raw_buffer.v3.raw_buffer_pb2 as raw_buffer_pb2
import envoy.extensions.transport_sockets.tls.v3.tls_pb2 as tls_pb2
import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2 as http_protocol_options_pb2
import envoy.type.matcher.v3.string_pb2 as string_pb2
import envoy.type.metadata.v3.metadata_pb2 as metadata_pb2
import envoy.type.v3.http_status_pb2 as http_status_pb2
import envoy.type.v3.range_pb2 as range_pb2
from google.protobuf import any_pb2, duration_pb2, json_format, struct_pb2, wrappers_pb2

# Set by the model router and the EPP respectively, never by a client (internal-only below).
from kvgate.api.contracts.disaggregation import PREFILLER_HEADER
from kvgate.api.contracts.model_routing import POOL_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DIRECT_ROUTE_HEADER = "x-kvgate-route"
UPSTREAM_HEADER = "x-kvgate-upstream"  # which engine answered (for tests and debugging)
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EPP_CLUSTER = "epp"
# transport-socket match key: health checks on a replica's plaintext health port skip the TLS
HEALTH_SOCKET = "kvgate-health"
MODEL_ROUTER_FILTER = "kvgate.model_router"  # a second ext_proc filter, ahead of the EPP's
MODEL_ROUTER_CLUSTER = "model_router"
ROUTED_CLUSTER = "original_destination"
FALLBACK_CLUSTER = "pool_fallback"
POOL_CLUSTER = "pool"
DIRECT_CLUSTER = "direct"
BATCH_CLUSTER = "batch"
# The OpenAI Files and Batches API, served by `kvgate batch serve` (never an engine's or the EPP's)
BATCH_PATH_PREFIXES = ["/v1/files", "/v1/batches"]
LB_METADATA_NAMESPACE = "envoy.lb"
# Request headers that only kvgate's own components may set: dropped at the gateway.
INTERNAL_REQUEST_HEADERS = ["x-kvgate-inject-failure"]
# Engine routes clients have no business calling through the gateway (vLLM serves them too).
INTERNAL_PATHS = ["/metrics", "/tokenize", "/detokenize", "/openapi.json", "/docs", "/redoc"]
INTERNAL_V1_PATHS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
INTERNAL_V1_PREFIXES = ["/v1/kv_transfer/"]  # an engine's pinned KV blocks (prefill/decode)
MiB = 1024 * 1024


@dataclass(frozen=True)
class GatewayLimits:
    """Every bound the gateway puts on a client, documented in one place (README "Gateway limits").

    - max_request_body_bytes: a declared body (Content-Length) over this gets 413 at Envoy; a
      chunked body is counted by the EPP as it streams and gets 413 there.
    - request_headers_timeout_s: a client must send its request headers within this (slowloris).
    - request_timeout_s: the whole request body must arrive, and the EPP answer, within this.
    - stream_idle_timeout_s: no byte either way for this long ends a stream. Streamed tokens
      arrive every few ms; a non-streamed request is silent for its whole generation, so this is
      the longest silent generation the gateway allows (a hung engine costs a client this much).
    - route_timeout_s: the hard cap on one request, streaming included.
    - epp_message_timeout_s: how long Envoy waits for the EPP's answer to one message.
    """

    max_request_body_bytes: int = 8 * MiB
    request_headers_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    stream_idle_timeout_s: float = 600.0
    route_timeout_s: float = 3600.0
    epp_message_timeout_s: float = 10.0


def _any(msg: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(msg)
    return packed


def _seconds(s: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(s * 1e9))
    return d


def _socket(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port))


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {hostport!r}")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _health_ports(ports: list[int] | None, replicas: int) -> list[int] | None:
    if ports is None:
        return None
    if len(ports) != replicas or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise ValueError(f"epp_health_ports: one port (1-65535) per EPP address ({replicas}), got {ports}")
    return list(ports)


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def _load_assignment(
    name: str, targets: list[tuple[str, int]], health_ports: list[int] | None = None
) -> endpoint_pb2.ClusterLoadAssignment:
    """``health_ports``: each target's health-check port, when not the target's own."""
    ports: list[int | None] = list(health_ports) if health_ports else [None] * len(targets)
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(
                            address=_socket(h, p),
                            health_check_config=endpoint_components_pb2.Endpoint.HealthCheckConfig(
                                port_value=health
                            )
                            if health
                            else None,
                        )
                    )
                    for (h, p), health in zip(targets, ports, strict=True)
                ]
            )
        ],
    )


def _header_present(name: str) -> route_components_pb2.HeaderMatcher:
    return route_components_pb2.HeaderMatcher(name=name, present_match=True)


def _epp_stream_retry() -> base_pb2.RetryPolicy:
    """An ext_proc stream whose EPP replica dies (reset, refused) before answering is opened
    again on another replica: Envoy keeps the stream's messages (headers, body chunks) for the
    retry and replays them, so the request is picked as if nothing happened. Three times: a
    stream whose connection to the dying replica was still being set up fails once on connect
    and once more on the retry's reset, and on a loaded machine one in ~100 needed a third
    attempt before the dead replica left rotation (e2e/test_epp_replica_killed.py lost 1 of 8
    with 2 retries, retry_limit_exceeded 1); each attempt avoids the hosts already tried."""
    return base_pb2.RetryPolicy(
        retry_on="connect-failure,refused-stream,reset,unavailable",
        num_retries=wrap(3),
        retry_host_predicate=[
            base_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
    )


def _epp_service(cluster: str) -> grpc_service_pb2.GrpcService:
    return grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=cluster),
        timeout=_seconds(10),
        retry_policy=_epp_stream_retry(),
    )


def _ext_proc_filter(
    failure_mode: str, message_timeout: float, response_phase: bool, cluster: str = EPP_CLUSTER
) -> ext_proc_pb2.ExternalProcessor:
    mode = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_epp_service(cluster),
        failure_mode_allow=failure_mode == "FailOpen",
        # FailClose with no EPP answering: the pool is unavailable, not broken (Envoy says 500)
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        # Response phase off by default: a picker that dies or stalls cannot touch a stream a
        # healthy engine is serving (the EPP learns load from engine metrics instead). On, the
        # EPP sees every response (model-name rewrite back, exact in-flight counts) at the cost
        # of sitting in every stream.
        processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=mode.SEND,
            response_header_mode=mode.SEND if response_phase else mode.SKIP,
            request_body_mode=mode.FULL_DUPLEX_STREAMED,
            response_body_mode=mode.FULL_DUPLEX_STREAMED if response_phase else mode.NONE,
            request_trailer_mode=mode.SEND,
            response_trailer_mode=mode.SEND if response_phase else mode.SKIP,
        ),
        message_timeout=_seconds(message_timeout),
        max_message_timeout=_seconds(message_timeout),
        # forward the subset hint a gateway may have attached, so the EPP can honour it
        metadata_options=ext_proc_pb2.MetadataOptions(
            forwarding_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[SUBSET_HINT_NAMESPACE]
            )
        ),
    )


def _error_body(status: int, message: str, code: str) -> str:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def _direct_json(status: int, message: str, code: str) -> route_components_pb2.DirectResponseAction:
    return route_components_pb2.DirectResponseAction(
        status=status, body=base_pb2.DataSource(inline_string=_error_body(status, message, code))
    )


_JSON_CONTENT = [
    base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", value="application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
]


def _no_ext_proc(model_router: bool = False) -> dict[str, any_pb2.Any]:
    """Per-route config turning the EPP off (and the model router, when there is one)."""
    off = _any(ext_proc_pb2.ExtProcPerRoute(disabled=True))
    return {EXT_PROC_FILTER: off, MODEL_ROUTER_FILTER: off} if model_router else {EXT_PROC_FILTER: off}


def _json_reply(
    name: str,
    match: route_components_pb2.RouteMatch,
    status: int,
    message: str,
    code: str,
    model_router: bool = False,
) -> route_components_pb2.Route:
    """A route Envoy answers itself with an OpenAI-shaped error, never asking the EPP."""
    return route_components_pb2.Route(
        name=name,
        match=match,
        direct_response=_direct_json(status, message, code),
        typed_per_filter_config=_no_ext_proc(model_router),
        response_headers_to_add=_JSON_CONTENT,
    )


def _retry_elsewhere(retry_on: str, num_retries: int, max_attempts: int) -> route_components_pb2.RetryPolicy:
    """Retry on 503 and `retry_on`, each attempt on a host not tried yet."""
    return route_components_pb2.RetryPolicy(
        retry_on=f"{retry_on},retriable-status-codes",
        retriable_status_codes=[503],
        num_retries=wrap(num_retries),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=max_attempts,
    )


# Retries in flight per engine cluster. Envoy's default circuit breaker allows 3: when an engine
# dies under 20 concurrent clients, every request past the third that met it got its 503 (or a
# connect error) back instead of its retry. Each request still retries at most num_retries times.
MAX_RETRIES_IN_FLIGHT = 1024


# ext_proc streams open at once to one EPP cluster. Envoy's default circuit breaker (1,024
# requests) failed requests with 503 (upstream_rq_active_overflow) once an overloaded EPP held
# that many, though each would have been answered, later, within Envoy's timeouts: the EPP's own
# saturation detector, not a stream count, decides what to shed. The same bound as the EPP's
# HTTP/2 limit (kvgate.epp.grpclib_server.MAX_CONCURRENT_STREAMS).
MAX_EXT_PROC_STREAMS = 65_536


def _retry_room(max_requests: int | None = None) -> circuit_breaker_pb2.CircuitBreakers:
    thresholds = circuit_breaker_pb2.CircuitBreakers.Thresholds(max_retries=wrap(MAX_RETRIES_IN_FLIGHT))
    if max_requests is not None:
        thresholds.max_requests.value = max_requests
        thresholds.max_pending_requests.value = max_requests
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[thresholds])


def _eject_on_refused_connection() -> outlier_detection_pb2.OutlierDetection:
    """A host that refuses one connection leaves rotation for 2 s, between health checks."""
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=wrap(1),
        base_ejection_time=_seconds(2),
        max_ejection_percent=wrap(100),
    )


def _local_replies() -> hcm_pb2.LocalReplyConfig:
    """Envoy's own error replies (no healthy engine, reset, timeouts) as OpenAI-shaped JSON.

    Matched by response flag, so the EPP's own immediate responses (already JSON) and engine
    answers pass untouched."""

    def body(kind: str, message: str = "%LOCAL_REPLY_BODY%") -> substitution_pb2.SubstitutionFormatString:
        fmt = struct_pb2.Struct()
        fmt.update(
            {
                "error": {
                    "message": message,
                    "type": kind,
                    "param": None,
                    "code": "%RESPONSE_CODE_DETAILS%",
                }
            }
        )
        return substitution_pb2.SubstitutionFormatString(json_format=fmt, content_type="application/json")

    def flags(*names: str) -> accesslog_pb2.AccessLogFilter:
        return accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=list(names))
        )

    return hcm_pb2.LocalReplyConfig(
        mappers=[
            hcm_pb2.ResponseMapper(
                filter=flags("UH", "UF", "URX", "UC", "UR", "UO", "NR", "UT", "SI", "DPE", "UPE", "NC"),
                body_format_override=body("service_unavailable"),
            ),
            # the ext_proc stream failed (FailClose, EPP down or silent): Envoy's reply has no
            # body at all. Matched on its details, so the EPP's own (JSON) 503s pass untouched.
            hcm_pb2.ResponseMapper(
                filter=accesslog_pb2.AccessLogFilter(
                    extension_filter=accesslog_pb2.ExtensionFilter(
                        name="envoy.access_loggers.extension_filters.cel",
                        typed_config=_any(
                            cel_pb2.ExpressionFilter(
                                expression="response.code_details.startsWith('ext_proc_error')"
                            )
                        ),
                    )
                ),
                body_format_override=body("service_unavailable", "no endpoint picker answered"),
            ),
        ],
    )


@dataclass(frozen=True)
class PoolSpec:
    """One pool behind the gateway: its own EPP replicas pick the engine.

    ``name``: None for the only pool of a gateway without a model router (its clusters and routes
    keep the plain names: ``epp``, ``pool``, ``picked``...); behind the model router, a DNS-style
    label the router names per request (``x-kvgate-pool``), suffixed to the pool's clusters and
    routes (``epp-<name>``, ``picked <name>``).
    ``epp_addresses``: every EPP replica (host:port), all serving at once.
    ``epp_health_ports``: each replica's ``--grpc-health-port`` (one port for all of a host name),
    where Envoy's health check asks; without it, the ext_proc port itself (a replica busy enough
    to answer it late is then taken for a dead one).
    ``pool_endpoints``: the engines, when known up front (the local stack), or a host name that
    resolves to every engine (a headless Service of the pool's pods, the chart). Then the picked
    route goes to a cluster of exactly those hosts with Envoy's override-host policy: the EPP's
    choice first, and a request that fails before its first response byte (connect failure,
    reset, 503 from a draining engine) is retried once on the EPP's next fallback, never on the
    same dead address. Without it, an ORIGINAL_DST cluster connects to whatever ip:port the EPP
    names and cannot retry elsewhere.
    ``fallback_endpoints``: with FailOpen, where requests no EPP replica could see go, round robin.
    """

    name: str | None
    epp_addresses: list[str]
    pool_endpoints: list[str] | None = None
    fallback_endpoints: list[str] | None = None
    epp_health_ports: list[int] | None = None


@dataclass(frozen=True)
class GatewaySpec:
    """Everything one Envoy bootstrap is built from: its pools and the listener's settings.

    One pool (``GatewaySpec.one_pool``) is the EPP's own gateway. Several pools, each named, need
    ``model_router_addresses``: the model router (``kvgate router serve``, an ext_proc filter ahead
    of the EPP's) reads each body's model and names the pool in ``x-kvgate-pool``; each pool's
    routes match that header and send the EPP's ext_proc stream to the pool's own EPP replicas (a
    per-route override).

    ``failure_mode``: ``FailOpen`` lets requests through when the EPP is unreachable (to the
    pool's ``fallback_endpoints`` round-robin, when given); ``FailClose`` answers them with an
    error.
    ``direct_upstream``: ip:port reached by requests carrying ``x-kvgate-route: direct``,
    bypassing ext_proc (a same-Envoy baseline for latency measurements).
    ``epp_health_check``: health-check the EPP replicas (off: one replica, which could only fail
    over to nothing).
    ``response_phase``: the EPP sees responses too (see ``_ext_proc_filter``).
    ``expose_upstream_header``: add ``x-kvgate-upstream`` (the engine that answered) to
    responses; for tests and benchmarks, off for real traffic.
    ``expose_internal_routes``: let /metrics, /tokenize... through (off: 404).
    ``admin_host``: where Envoy's admin interface listens; never a public address.
    ``batch_upstreams``: the batch service's replicas (ip:port or host:port, ``kvgate batch
    serve``): /v1/files and /v1/batches (and below) go there round robin, without the EPP, and
    without the gateway's body limit (an input file may be larger; the service has its own).
    """

    pools: list[PoolSpec]
    listen_port: int
    listen_host: str = "127.0.0.1"
    admin_port: int = 0
    admin_host: str = "127.0.0.1"
    failure_mode: str = "FailClose"
    epp_tls: bool = False
    epp_health_check: bool = True
    response_phase: bool = False
    expose_upstream_header: bool = False
    expose_internal_routes: bool = False
    direct_upstream: str | None = None
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    model_router_addresses: list[str] | None = None
    batch_upstreams: list[str] | None = None

    @classmethod
    def one_pool(
        cls,
        epp_addresses: list[str],
        *,
        pool_endpoints: list[str] | None = None,
        fallback_endpoints: list[str] | None = None,
        epp_health_ports: list[int] | None = None,
        **settings: Any,
    ) -> GatewaySpec:
        """A gateway for one pool (no model router); ``settings`` are GatewaySpec's fields."""
        pool = PoolSpec(None, list(epp_addresses), pool_endpoints, fallback_endpoints, epp_health_ports)
        return cls([pool], **settings)

    @property
    def routed(self) -> bool:
        """Several pools behind the model router (each pool's clusters and routes named)."""
        return bool(self.model_router_addresses)


@dataclass(frozen=True)
class _Pool:
    """A pool's clusters and routes as the bootstrap names them."""

    label: str | None  # None: the single pool of a one-pool gateway (historic names)
    epps: list[tuple[str, int]]
    engines: list[tuple[str, int]]
    fallback: list[tuple[str, int]]
    epp_health_ports: list[int] | None = None

    def _name(self, base: str) -> str:
        return base if self.label is None else f"{base}-{self.label}"

    @property
    def epp_cluster(self) -> str:
        return self._name(EPP_CLUSTER)

    @property
    def pool_cluster(self) -> str:
        return self._name(POOL_CLUSTER)

    @property
    def fallback_cluster(self) -> str:
        return self._name(FALLBACK_CLUSTER)

    def route(self, base: str) -> str:
        return base if self.label is None else f"{base} {self.label}"

    @property
    def by_dns(self) -> bool:
        # A host name (a headless Service of the engine pods, in a cluster) stands for every
        # engine it resolves to; how many is unknown here.
        return any(not _is_ip(h) for h, _ in self.engines)


def _pools(spec: GatewaySpec) -> list[_Pool]:
    """The spec's pools, checked, with their addresses parsed."""
    if spec.routed:
        names = [p.name for p in spec.pools]
        if len(set(names)) != len(names) or not all(n and n.replace("-", "").isalnum() for n in names):
            raise ValueError(f"pool names must be unique DNS-style labels, got {names}")
    elif len(spec.pools) != 1 or spec.pools[0].name is not None:
        raise ValueError("several pools need the model router's address (model_router_addresses)")
    return [
        _Pool(
            p.name,
            [_split(a) for a in p.epp_addresses],
            [_split(e) for e in p.pool_endpoints or []],
            [_split(e) for e in p.fallback_endpoints or []],
            _health_ports(p.epp_health_ports, len(p.epp_addresses)),
        )
        for p in spec.pools
    ]


def build_bootstrap(spec: GatewaySpec) -> dict[str, Any]:
    """The bootstrap as a dict (the protos' JSON mapping); dump it as YAML or JSON for Envoy."""
    if spec.failure_mode not in ("FailOpen", "FailClose"):
        raise ValueError(f"failure_mode must be FailOpen or FailClose, got {spec.failure_mode!r}")
    pools = _pools(spec)
    boot = bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=_socket(spec.admin_host, spec.admin_port)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[_listener(spec, pools)], clusters=_clusters(spec, pools)
        ),
    )
    # via JSON text: MessageToDict leaves OrderedDicts inside Any fields, which YAML cannot dump
    # sorted keys: the same config renders byte-identically in every process (Struct maps do not)
    return json.loads(json_format.MessageToJson(boot, preserving_proto_field_name=True, sort_keys=True))


def _routes(spec: GatewaySpec, pools: list[_Pool]) -> list[route_components_pb2.Route]:
    """The virtual host's routes, first match wins: the direct baseline, Envoy's own refusals
    (body too large, internal paths), each pool's routes, then what matched no pool."""
    limits, multi = spec.limits, spec.routed
    routes: list[route_components_pb2.Route] = []
    if spec.direct_upstream:
        routes.append(
            route_components_pb2.Route(
                name="direct",
                match=route_components_pb2.RouteMatch(
                    prefix="/",
                    headers=[
                        route_components_pb2.HeaderMatcher(
                            name=DIRECT_ROUTE_HEADER, string_match=string_pb2.StringMatcher(exact="direct")
                        )
                    ],
                ),
                route=route_components_pb2.RouteAction(
                    cluster=DIRECT_CLUSTER,
                    timeout=_seconds(limits.route_timeout_s),
                    idle_timeout=_seconds(limits.stream_idle_timeout_s),
                ),
                typed_per_filter_config=_no_ext_proc(multi),
            )
        )
    for prefix in BATCH_PATH_PREFIXES if spec.batch_upstreams else []:
        routes.append(
            route_components_pb2.Route(
                name=f"batch {prefix}",
                # /v1/files and /v1/files/..., not /v1/filesystem
                match=route_components_pb2.RouteMatch(path_separated_prefix=prefix),
                route=route_components_pb2.RouteAction(
                    cluster=BATCH_CLUSTER,
                    timeout=_seconds(limits.route_timeout_s),
                    idle_timeout=_seconds(limits.stream_idle_timeout_s),
                    # a replica that refused the connection: try another
                    retry_policy=route_components_pb2.RetryPolicy(
                        retry_on="connect-failure,refused-stream", num_retries=wrap(2)
                    ),
                ),
                typed_per_filter_config=_no_ext_proc(multi),
            )
        )
    # A declared body over the limit never reaches the EPP (ext_proc is off on this route).
    too_large = route_components_pb2.RouteMatch(
        prefix="/",
        headers=[
            route_components_pb2.HeaderMatcher(
                name="content-length",
                range_match=range_pb2.Int64Range(start=limits.max_request_body_bytes + 1, end=2**62),
            )
        ],
    )
    routes.append(
        _json_reply(
            "body_too_large",
            too_large,
            413,
            f"request body larger than {limits.max_request_body_bytes} bytes",
            "body_too_large",
            multi,
        )
    )
    if not spec.expose_internal_routes:
        for path in INTERNAL_V1_PATHS:
            match = route_components_pb2.RouteMatch(path=path)
            routes.append(_json_reply(f"internal {path}", match, 404, f"no route {path}", "not_found", multi))
        for prefix in INTERNAL_V1_PREFIXES:
            match = route_components_pb2.RouteMatch(prefix=prefix)
            routes.append(
                _json_reply(f"internal {prefix}", match, 404, f"no route {prefix}", "not_found", multi)
            )
    served_prefix = "/" if spec.expose_internal_routes else "/v1/"
    for gw in pools:
        routes += _pool_routes(spec, gw, served_prefix)
    if multi:
        # Before the model router has named a pool (and for what it lets through unnamed: a
        # request without a body) no pool route matches. The model router must still run here,
        # so only the EPP is off on this route.
        routes.append(
            route_components_pb2.Route(
                name="no_pool",
                match=route_components_pb2.RouteMatch(prefix=served_prefix),
                direct_response=_direct_json(404, "no model named: send a body with a 'model'", "not_found"),
                typed_per_filter_config={EXT_PROC_FILTER: _any(ext_proc_pb2.ExtProcPerRoute(disabled=True))},
                response_headers_to_add=_JSON_CONTENT,
            )
        )
    if not spec.expose_internal_routes:
        # Only the OpenAI API is public: engine internals (/metrics, /tokenize, /openapi.json,
        # admin routes) answer 404 here without reaching the EPP or an engine.
        routes.append(
            _json_reply(
                "not_public",
                route_components_pb2.RouteMatch(prefix="/"),
                404,
                "no such route on this gateway",
                "not_found",
                multi,
            )
        )
    return routes


def _listener(spec: GatewaySpec, pools: list[_Pool]) -> listener_pb2.Listener:
    """The client-facing listener: HTTP connection manager → [model router] → EPP → router."""
    limits, multi = spec.limits, spec.routed
    filters = [
        hcm_pb2.HttpFilter(
            name=EXT_PROC_FILTER,
            typed_config=_any(
                _ext_proc_filter(
                    spec.failure_mode, limits.epp_message_timeout_s, spec.response_phase, pools[0].epp_cluster
                )
            ),
        ),
        hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router_pb2.Router())),
    ]
    if multi:
        filters.insert(
            0,
            hcm_pb2.HttpFilter(
                name=MODEL_ROUTER_FILTER,
                typed_config=_any(_model_router_filter(limits.epp_message_timeout_s)),
            ),
        )
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="kvgate",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        # A client must never choose its own engine: the destination header is the EPP's alone.
        # Envoy strips internal-only headers from external requests before any filter runs
        # (so before routing), which also covers FailOpen, when the EPP never sees the request.
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        preserve_external_request_id=True,  # the client's x-request-id follows the request (GIE)
        # /v1/../metrics or //metrics must not slip past the path routes
        normalize_path=wrappers_pb2.BoolValue(value=True),
        merge_slashes=True,
        path_with_escaped_slashes_action=hcm_pb2.HttpConnectionManager.UNESCAPE_AND_REDIRECT,
        route_config=route_pb2.RouteConfiguration(
            name="kvgate",
            # nor its own pool: that is the model router's
            internal_only_headers=[DESTINATION_HEADER, PREFILLER_HEADER, POOL_HEADER]
            if multi
            else [DESTINATION_HEADER, PREFILLER_HEADER],
            request_headers_to_remove=INTERNAL_REQUEST_HEADERS,
            virtual_hosts=[
                route_components_pb2.VirtualHost(name="pool", domains=["*"], routes=_routes(spec, pools))
            ],
        ),
        http_filters=filters,
        # slow clients (slowloris): headers, then the whole request, within bounds
        request_headers_timeout=_seconds(limits.request_headers_timeout_s),
        request_timeout=_seconds(limits.request_timeout_s),
        stream_idle_timeout=_seconds(limits.stream_idle_timeout_s),
        local_reply_config=_local_replies(),
    )
    return listener_pb2.Listener(
        name="kvgate",
        address=_socket(spec.listen_host, spec.listen_port),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=_any(hcm)
                    )
                ]
            )
        ],
    )


def _clusters(spec: GatewaySpec, pools: list[_Pool]) -> list[cluster_pb2.Cluster]:
    """Every pool's EPP cluster, the EPP-named destination, every pool's engines and fallback,
    the model router's replicas and the direct baseline's upstream."""
    clusters: list[cluster_pb2.Cluster] = [
        _grpc_cluster(gw.epp_cluster, gw.epps, spec.epp_health_check, spec.epp_tls, gw.epp_health_ports)
        for gw in pools
    ]
    clusters.append(
        cluster_pb2.Cluster(
            name=ROUTED_CLUSTER,
            type=cluster_pb2.Cluster.ORIGINAL_DST,
            lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
            connect_timeout=_seconds(5),
            original_dst_lb_config=cluster_pb2.Cluster.OriginalDstLbConfig(
                use_http_header=True, http_header_name=DESTINATION_HEADER
            ),
        )
    )
    for gw in pools:
        if gw.engines:
            clusters.append(_override_host_cluster(gw.engines, by_dns=gw.by_dns, name=gw.pool_cluster))
        if gw.fallback:
            clusters.append(_fallback_cluster(gw.fallback_cluster, gw.fallback))
    if spec.model_router_addresses:
        routers = [_split(a) for a in spec.model_router_addresses]
        # one replica: a health check could only fail over to nothing (see the EPP's)
        clusters.append(_grpc_cluster(MODEL_ROUTER_CLUSTER, routers, len(routers) > 1, False))
    if spec.batch_upstreams:
        batch = [_split(a) for a in spec.batch_upstreams]
        clusters.append(
            cluster_pb2.Cluster(
                name=BATCH_CLUSTER,
                type=cluster_pb2.Cluster.STRICT_DNS
                if any(not _is_ip(h) for h, _ in batch)
                else cluster_pb2.Cluster.STATIC,
                connect_timeout=_seconds(5),
                lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
                load_assignment=_load_assignment(BATCH_CLUSTER, batch),
                # one replica: ejecting it could only fail over to nothing
                outlier_detection=_eject_on_refused_connection() if len(batch) > 1 else None,
            )
        )
    if spec.direct_upstream:
        clusters.append(
            cluster_pb2.Cluster(
                name=DIRECT_CLUSTER,
                type=cluster_pb2.Cluster.STATIC,
                connect_timeout=_seconds(5),
                lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
                load_assignment=_load_assignment(DIRECT_CLUSTER, [_split(spec.direct_upstream)]),
            )
        )
    return clusters


def _pool_routes(spec: GatewaySpec, gw: _Pool, served_prefix: str) -> list[route_components_pb2.Route]:
    """A pool's two routes: requests its EPP picked an engine for, and those it did not (yet)."""
    limits, multi = spec.limits, spec.routed
    route_timeout, idle = _seconds(limits.route_timeout_s), _seconds(limits.stream_idle_timeout_s)
    upstream_headers = (
        [
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=UPSTREAM_HEADER, value="%UPSTREAM_REMOTE_ADDRESS%"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ]
        if spec.expose_upstream_header
        else []
    )
    pool, fallback = gw.engines, gw.fallback
    # with several pools: this pool's requests only, and the EPP stream goes to its own EPP
    only_this_pool = (
        [
            route_components_pb2.HeaderMatcher(
                name=POOL_HEADER, string_match=string_pb2.StringMatcher(exact=gw.label)
            )
        ]
        if multi and gw.label
        else []
    )
    its_epp = (
        {
            EXT_PROC_FILTER: _any(
                ext_proc_pb2.ExtProcPerRoute(
                    overrides=ext_proc_pb2.ExtProcOverrides(grpc_service=_epp_service(gw.epp_cluster))
                )
            )
        }
        if multi
        else None
    )
    # Only failures before any response byte ("reset" is a disconnect before the response
    # started): the client has seen nothing, and a generation has no side effects, so running
    # it elsewhere loses nothing. An engine's 503 is sent before it starts a request (draining,
    # dead loop), never mid-stream. Twice: with one engine draining and another just killed,
    # the first retry may meet the second casualty.
    picked_action = route_components_pb2.RouteAction(
        cluster=gw.pool_cluster if pool else ROUTED_CLUSTER, timeout=route_timeout, idle_timeout=idle
    )
    if pool:
        picked_action.retry_policy.CopyFrom(
            _retry_elsewhere(
                "connect-failure,refused-stream,reset",
                2 if gw.by_dns else max(1, min(2, len(pool) - 1)),
                max_attempts=3,
            )
        )
    picked = route_components_pb2.Route(
        name=gw.route("picked"),
        match=route_components_pb2.RouteMatch(
            prefix=served_prefix, headers=[*only_this_pool, _header_present(DESTINATION_HEADER)]
        ),
        route=picked_action,
        response_headers_to_add=upstream_headers,
        # a retry re-sends the body: keep up to the largest allowed body for it
        request_body_buffer_limit=wrappers_pb2.UInt64Value(value=limits.max_request_body_bytes)
        if pool
        else None,
        typed_per_filter_config=its_epp,
    )
    # Before the EPP answers (and whenever it cannot), the request has no destination header.
    # With the engines known as a pool (and no fallback list), FailOpen's unpicked requests go
    # round robin over them: the override-host policy's fallback when no destination is named.
    unpicked_action = route_components_pb2.RouteAction(
        cluster=gw.fallback_cluster if fallback else gw.pool_cluster if pool else ROUTED_CLUSTER,
        timeout=route_timeout,
        idle_timeout=idle,
    )
    if fallback:
        # Without the EPP nobody knows which engine is alive: retry connection failures elsewhere
        # (safe: the request never reached an engine), on top of the cluster's health checks.
        unpicked_action.retry_policy.CopyFrom(
            _retry_elsewhere(
                "connect-failure,refused-stream,reset-before-request", len(fallback), max_attempts=5
            )
        )
    unpicked = route_components_pb2.Route(
        name=gw.route("unpicked"),
        match=route_components_pb2.RouteMatch(prefix=served_prefix, headers=only_this_pool),
        route=unpicked_action,
        response_headers_to_add=upstream_headers,
        typed_per_filter_config=its_epp,
    )
    return [picked, unpicked]


def _model_router_filter(message_timeout: float) -> ext_proc_pb2.ExternalProcessor:
    """The model router's ext_proc: request headers and body only (it holds the body, names the
    pool, hands it back). FailClose: without it no request can be given a pool."""
    mode = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_epp_service(MODEL_ROUTER_CLUSTER),
        failure_mode_allow=False,
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=mode.SEND,
            response_header_mode=mode.SKIP,
            request_body_mode=mode.FULL_DUPLEX_STREAMED,
            response_body_mode=mode.NONE,
            request_trailer_mode=mode.SEND,
            response_trailer_mode=mode.SKIP,
        ),
        message_timeout=_seconds(message_timeout),
        max_message_timeout=_seconds(message_timeout),
    )


def _grpc_cluster(
    name: str,
    hosts: list[tuple[str, int]],
    health_check: bool,
    tls: bool,
    health_ports: list[int] | None = None,
) -> cluster_pb2.Cluster:
    """An ext_proc server's replicas (an EPP's, the model router's): HTTP/2, all serving.

    ``health_ports``: where each replica answers gRPC health, when not on its ext_proc port.
    An EPP answers there from threads of its own, so a replica whose event loop is saturated
    (slow, not dead) stays in rotation instead of failing every request (kvgate.epp.health);
    that port is plaintext, so the checks skip the cluster's TLS."""
    h2 = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    all_ips = all(_is_ip(h) for h, _ in hosts)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC if all_ips else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_seconds(1),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        load_assignment=_load_assignment(name, hosts, health_ports if health_check else None),
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(h2),
        },
        # No panic routing to an EPP known to be down: with zero healthy hosts the ext_proc
        # stream fails at once, before any body is streamed, so FailOpen can still let the
        # request through (a body already handed to a dying stream cannot be recovered).
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(healthy_panic_threshold=percent(0)),
        # A host name (a headless Service in a cluster) names every ready replica: one host per
        # address, re-resolved each second so a new or rescheduled replica joins quickly.
        dns_refresh_rate=None if all_ips else _seconds(1),
        # every stream a killed replica held is retried at once (see _epp_stream_retry), and an
        # overloaded EPP's streams wait rather than overflow
        circuit_breakers=_retry_room(MAX_EXT_PROC_STREAMS),
    )
    if health_check:
        cluster.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=_seconds(1),
                interval=_seconds(0.5),
                no_traffic_interval=_seconds(0.5),
                # two misses in a row: one slow answer on a busy node is not an outage
                unhealthy_threshold=wrap(2),
                healthy_threshold=wrap(1),
                grpc_health_check=health_check_pb2.HealthCheck.GrpcHealthCheck(
                    service_name="envoy.service.ext_proc.v3.ExternalProcessor"
                ),
            )
        )
        if health_ports:  # plaintext whether or not the ext_proc port has TLS
            cluster.health_checks[0].transport_socket_match_criteria.update({HEALTH_SOCKET: "plaintext"})
            cluster.transport_socket_matches.append(
                cluster_pb2.Cluster.TransportSocketMatch(
                    name="health-plaintext",
                    match=_struct({HEALTH_SOCKET: "plaintext"}),
                    transport_socket=base_pb2.TransportSocket(
                        name="envoy.transport_sockets.raw_buffer",
                        typed_config=_any(raw_buffer_pb2.RawBuffer()),
                    ),
                )
            )
        # a replica that refuses connections leaves rotation at once, between health checks
        cluster.outlier_detection.CopyFrom(_eject_on_refused_connection())
    if tls:
        # GIE's EPP serves a self-signed certificate; the gateway encrypts without verifying it.
        cluster.transport_socket.CopyFrom(
            base_pb2.TransportSocket(
                name="envoy.transport_sockets.tls",
                typed_config=_any(
                    tls_pb2.UpstreamTlsContext(
                        common_tls_context=tls_pb2.CommonTlsContext(alpn_protocols=["h2"]), sni=hosts[0][0]
                    )
                ),
            )
        )
    return cluster


def _fallback_cluster(name: str, fallback: list[tuple[str, int]]) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_seconds(5),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        load_assignment=_load_assignment(name, fallback),
        circuit_breakers=_retry_room(),
        # a killed engine leaves the round robin at its first refusal, not at the next
        # 2 s health check
        outlier_detection=_eject_on_refused_connection(),
        health_checks=[
            health_check_pb2.HealthCheck(
                timeout=_seconds(1),
                interval=_seconds(2),
                unhealthy_threshold=wrap(1),
                healthy_threshold=wrap(1),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path="/health"),
            )
        ],
    )


def _override_host_cluster(
    pool: list[tuple[str, int]], by_dns: bool = False, name: str = POOL_CLUSTER
) -> cluster_pb2.Cluster:
    """The engines as hosts, chosen by the EPP: Envoy's override-host policy (made for GIE)
    reads the destination list (chosen first, then fallbacks) from the EPP's envoy.lb metadata
    or header, and a retry takes the next entry. Unknown destinations fall back to round robin.
    `by_dns`: the pool is a host name (a headless Service of the engine pods) re-resolved each
    second, one host per address; a pod the EPP picks before DNS lists it is served round robin."""
    policy = override_host_pb2.OverrideHost(
        override_host_sources=[
            override_host_pb2.OverrideHost.OverrideHostSource(
                metadata=metadata_pb2.MetadataKey(
                    key=LB_METADATA_NAMESPACE,
                    path=[metadata_pb2.MetadataKey.PathSegment(key=DESTINATION_HEADER)],
                )
            ),
            override_host_pb2.OverrideHost.OverrideHostSource(header=DESTINATION_HEADER),
        ],
        fallback_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[
                cluster_pb2.LoadBalancingPolicy.Policy(
                    typed_extension_config=extension_pb2.TypedExtensionConfig(
                        name="envoy.load_balancing_policies.round_robin",
                        typed_config=_any(round_robin_pb2.RoundRobin()),
                    )
                )
            ]
        ),
    )
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STRICT_DNS if by_dns else cluster_pb2.Cluster.STATIC,
        dns_refresh_rate=_seconds(1) if by_dns else None,
        dns_lookup_family=cluster_pb2.Cluster.V4_PREFERRED if by_dns else cluster_pb2.Cluster.AUTO,
        connect_timeout=_seconds(2),
        load_assignment=_load_assignment(name, pool),
        # an engine that refuses a connection is skipped by the retries' fallback for a while
        outlier_detection=_eject_on_refused_connection(),
        circuit_breakers=_retry_room(),
        load_balancing_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[
                cluster_pb2.LoadBalancingPolicy.Policy(
                    typed_extension_config=extension_pb2.TypedExtensionConfig(
                        name="envoy.load_balancing_policies.override_host", typed_config=_any(policy)
                    )
                )
            ]
        ),
    )


def percent(value: float) -> Any:
    from envoy.type.v3 import percent_pb2

    return percent_pb2.Percent(value=value)


def wrap(n: int) -> Any:
    from google.protobuf import wrappers_pb2

    return wrappers_pb2.UInt32Value(value=n)


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(
        prog="python -m kvgate.gateway.envoy_config", description="print an Envoy bootstrap for the EPP"
    )
    p.add_argument("--listen-port", type=int, default=8080, help="port clients send OpenAI requests to")
    p.add_argument("--epp", default="127.0.0.1:9002", help="EPP ext_proc address host:port")
    p.add_argument(
        "--failure-mode", choices=["FailOpen", "FailClose"], default="FailClose", help="when the EPP is down"
    )
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port")
    p.add_argument(
        "--direct-upstream", default=None, help="ip:port for the x-kvgate-route: direct baseline route"
    )
    p.add_argument(
        "--fallback-endpoints",
        default="",
        help="ip:port,... served round-robin when FailOpen and the EPP is down",
    )
    p.add_argument("--epp-tls", action="store_true", help="the EPP serves TLS (its default --secure-serving)")
    args = p.parse_args(argv)
    try:
        boot = build_bootstrap(
            GatewaySpec.one_pool(
                [args.epp],
                fallback_endpoints=[e for e in args.fallback_endpoints.split(",") if e],
                listen_port=args.listen_port,
                failure_mode=args.failure_mode,
                admin_port=args.admin_port,
                direct_upstream=args.direct_upstream,
                epp_tls=args.epp_tls,
            )
        )
    except ValueError as exc:
        print(f"envoy_config: {exc}", file=sys.stderr)
        return 2
    yaml.safe_dump(boot, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A standalone Envoy bootstrap for the EPP, built from Envoy's typed protos (never templates).

Listener → HTTP connection manager → ext_proc filter (GIE settings: full-duplex streamed
bodies, header/trailer modes SEND) → router. Requests the EPP routed carry
``x-gateway-destination-endpoint`` and go to an ``ORIGINAL_DST`` cluster that connects to
exactly that ip:port. With FailOpen and a fallback endpoint list, requests that the EPP could
not see (it is down) go round-robin to the pool instead. An optional direct route (header
``x-kvgate-route: direct``) skips ext_proc entirely: the latency baseline.

``python -m kvgate.epp.envoy_config --help`` prints the bootstrap as YAML.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from typing import Any

import envoy.config.bootstrap.v3.bootstrap_pb2 as bootstrap_pb2
import envoy.config.cluster.v3.cluster_pb2 as cluster_pb2
import envoy.config.core.v3.address_pb2 as address_pb2
import envoy.config.core.v3.base_pb2 as base_pb2
import envoy.config.core.v3.config_source_pb2  # noqa: F401  (registers types MessageToDict may meet)
import envoy.config.core.v3.grpc_service_pb2 as grpc_service_pb2
import envoy.config.core.v3.health_check_pb2 as health_check_pb2
import envoy.config.core.v3.protocol_pb2 as protocol_pb2
import envoy.config.endpoint.v3.endpoint_components_pb2 as endpoint_components_pb2
import envoy.config.endpoint.v3.endpoint_pb2 as endpoint_pb2
import envoy.config.listener.v3.listener_components_pb2 as listener_components_pb2
import envoy.config.listener.v3.listener_pb2 as listener_pb2
import envoy.config.route.v3.route_components_pb2 as route_components_pb2
import envoy.config.route.v3.route_pb2 as route_pb2
import envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 as ext_proc_pb2
import envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 as processing_mode_pb2
import envoy.extensions.filters.http.router.v3.router_pb2 as router_pb2
import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 as hcm_pb2
import envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2 as previous_hosts_pb2
import envoy.extensions.transport_sockets.tls.v3.tls_pb2 as tls_pb2
import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2 as http_protocol_options_pb2
import envoy.type.matcher.v3.string_pb2 as string_pb2
from google.protobuf import any_pb2, duration_pb2, json_format, wrappers_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
DIRECT_ROUTE_HEADER = "x-kvgate-route"
UPSTREAM_HEADER = "x-kvgate-upstream"  # which engine answered (for tests and debugging)
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EPP_CLUSTER = "epp"
ROUTED_CLUSTER = "original_destination"
FALLBACK_CLUSTER = "pool_fallback"
DIRECT_CLUSTER = "direct"


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


def _load_assignment(name: str, targets: list[tuple[str, int]]) -> endpoint_pb2.ClusterLoadAssignment:
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(address=_socket(h, p))
                    )
                    for h, p in targets
                ]
            )
        ],
    )


def _header_present(name: str) -> route_components_pb2.HeaderMatcher:
    return route_components_pb2.HeaderMatcher(name=name, present_match=True)


def _ext_proc_filter(failure_mode: str, message_timeout: float) -> ext_proc_pb2.ExternalProcessor:
    mode = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EPP_CLUSTER), timeout=_seconds(10)
        ),
        failure_mode_allow=failure_mode == "FailOpen",
        processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=mode.SEND,
            response_header_mode=mode.SEND,
            request_body_mode=mode.FULL_DUPLEX_STREAMED,
            response_body_mode=mode.FULL_DUPLEX_STREAMED,
            request_trailer_mode=mode.SEND,
            response_trailer_mode=mode.SEND,
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


def build_bootstrap(
    listen_port: int,
    epp_host: str,
    epp_port: int,
    failure_mode: str = "FailClose",
    admin_port: int = 0,
    direct_upstream: str | None = None,
    fallback_endpoints: list[str] | None = None,
    epp_tls: bool = False,
    listen_host: str = "127.0.0.1",
    message_timeout: float = 1000.0,
    epp_health_check: bool = True,
    expose_upstream_header: bool = True,
) -> dict[str, Any]:
    """The bootstrap as a dict (the protos' JSON mapping); dump it as YAML or JSON for Envoy.

    ``failure_mode``: ``FailOpen`` lets requests through when the EPP is unreachable (to
    ``fallback_endpoints`` round-robin, when given); ``FailClose`` answers them with an error.
    ``direct_upstream``: ip:port reached by requests carrying ``x-kvgate-route: direct``,
    bypassing ext_proc (a same-Envoy baseline for latency measurements).
    """
    if failure_mode not in ("FailOpen", "FailClose"):
        raise ValueError(f"failure_mode must be FailOpen or FailClose, got {failure_mode!r}")
    fallback = [_split(e) for e in fallback_endpoints or []]

    upstream_headers = (
        [
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=UPSTREAM_HEADER, value="%UPSTREAM_REMOTE_ADDRESS%"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ]
        if expose_upstream_header
        else []
    )
    no_timeout = _seconds(0)  # generations stream for minutes; Envoy's 15 s default would cut them
    routes: list[route_components_pb2.Route] = []
    if direct_upstream:
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
                route=route_components_pb2.RouteAction(cluster=DIRECT_CLUSTER, timeout=no_timeout),
                typed_per_filter_config={EXT_PROC_FILTER: _any(ext_proc_pb2.ExtProcPerRoute(disabled=True))},
            )
        )
    routes.append(
        route_components_pb2.Route(
            name="picked",
            match=route_components_pb2.RouteMatch(prefix="/", headers=[_header_present(DESTINATION_HEADER)]),
            route=route_components_pb2.RouteAction(cluster=ROUTED_CLUSTER, timeout=no_timeout),
            response_headers_to_add=upstream_headers,
        )
    )
    # Before the EPP answers (and whenever it cannot), the request has no destination header.
    unpicked = route_components_pb2.RouteAction(
        cluster=FALLBACK_CLUSTER if fallback else ROUTED_CLUSTER, timeout=no_timeout
    )
    if fallback:
        # Without the EPP nobody knows which engine is alive: retry connection failures elsewhere
        # (safe: the request never reached an engine), on top of the cluster's health checks.
        unpicked.retry_policy.CopyFrom(
            route_components_pb2.RetryPolicy(
                retry_on="connect-failure,refused-stream",
                num_retries=wrap(len(fallback)),
                retry_host_predicate=[
                    route_components_pb2.RetryPolicy.RetryHostPredicate(
                        name="envoy.retry_host_predicates.previous_hosts",
                        typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()),
                    )
                ],
                host_selection_retry_max_attempts=5,
            )
        )
    routes.append(
        route_components_pb2.Route(
            name="unpicked",
            match=route_components_pb2.RouteMatch(prefix="/"),
            route=unpicked,
            response_headers_to_add=upstream_headers,
        )
    )

    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="kvgate",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        # A client must never choose its own engine: the destination header is the EPP's alone.
        # Envoy strips internal-only headers from external requests before any filter runs
        # (so before routing), which also covers FailOpen, when the EPP never sees the request.
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        preserve_external_request_id=True,  # the client's x-request-id follows the request (GIE)
        route_config=route_pb2.RouteConfiguration(
            name="kvgate",
            internal_only_headers=[DESTINATION_HEADER],
            virtual_hosts=[route_components_pb2.VirtualHost(name="pool", domains=["*"], routes=routes)],
        ),
        http_filters=[
            hcm_pb2.HttpFilter(
                name=EXT_PROC_FILTER, typed_config=_any(_ext_proc_filter(failure_mode, message_timeout))
            ),
            hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router_pb2.Router())),
        ],
        stream_idle_timeout=_seconds(message_timeout),
    )
    listener = listener_pb2.Listener(
        name="kvgate",
        address=_socket(listen_host, listen_port),
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

    h2 = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    epp_cluster = cluster_pb2.Cluster(
        name=EPP_CLUSTER,
        type=cluster_pb2.Cluster.STATIC if _is_ip(epp_host) else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_seconds(1),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        load_assignment=_load_assignment(EPP_CLUSTER, [(epp_host, epp_port)]),
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(h2),
        },
        # No panic routing to an EPP known to be down: with zero healthy hosts the ext_proc
        # stream fails at once, before any body is streamed, so FailOpen can still let the
        # request through (a body already handed to a dying stream cannot be recovered).
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(healthy_panic_threshold=percent(0)),
    )
    if epp_health_check:
        epp_cluster.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=_seconds(0.5),
                interval=_seconds(0.5),
                no_traffic_interval=_seconds(0.5),
                unhealthy_threshold=wrap(1),
                healthy_threshold=wrap(1),
                grpc_health_check=health_check_pb2.HealthCheck.GrpcHealthCheck(
                    service_name="envoy.service.ext_proc.v3.ExternalProcessor"
                ),
            )
        )
    if epp_tls:
        # GIE's EPP serves a self-signed certificate; the gateway encrypts without verifying it.
        epp_cluster.transport_socket.CopyFrom(
            base_pb2.TransportSocket(
                name="envoy.transport_sockets.tls",
                typed_config=_any(
                    tls_pb2.UpstreamTlsContext(
                        common_tls_context=tls_pb2.CommonTlsContext(alpn_protocols=["h2"]), sni=epp_host
                    )
                ),
            )
        )

    routed = cluster_pb2.Cluster(
        name=ROUTED_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=_seconds(5),
        original_dst_lb_config=cluster_pb2.Cluster.OriginalDstLbConfig(
            use_http_header=True, http_header_name=DESTINATION_HEADER
        ),
    )
    clusters = [epp_cluster, routed]
    if fallback:
        clusters.append(
            cluster_pb2.Cluster(
                name=FALLBACK_CLUSTER,
                type=cluster_pb2.Cluster.STATIC,
                connect_timeout=_seconds(5),
                lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
                load_assignment=_load_assignment(FALLBACK_CLUSTER, fallback),
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
        )
    if direct_upstream:
        clusters.append(
            cluster_pb2.Cluster(
                name=DIRECT_CLUSTER,
                type=cluster_pb2.Cluster.STATIC,
                connect_timeout=_seconds(5),
                lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
                load_assignment=_load_assignment(DIRECT_CLUSTER, [_split(direct_upstream)]),
            )
        )

    boot = bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=_socket(listen_host, admin_port)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(listeners=[listener], clusters=clusters),
    )
    # via JSON text: MessageToDict leaves OrderedDicts inside Any fields, which YAML cannot dump
    return json.loads(json_format.MessageToJson(boot, preserving_proto_field_name=True))


def percent(value: float) -> Any:
    from envoy.type.v3 import percent_pb2

    return percent_pb2.Percent(value=value)


def wrap(n: int) -> Any:
    from google.protobuf import wrappers_pb2

    return wrappers_pb2.UInt32Value(value=n)


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(
        prog="python -m kvgate.epp.envoy_config", description="print an Envoy bootstrap for the EPP"
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
        host, port = _split(args.epp)
        boot = build_bootstrap(
            args.listen_port,
            host,
            port,
            args.failure_mode,
            args.admin_port,
            direct_upstream=args.direct_upstream,
            fallback_endpoints=[e for e in args.fallback_endpoints.split(",") if e],
            epp_tls=args.epp_tls,
        )
    except ValueError as exc:
        print(f"envoy_config: {exc}", file=sys.stderr)
        return 2
    yaml.safe_dump(boot, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

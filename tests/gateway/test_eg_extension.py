"""Envoy Gateway's extension hooks for InferencePool backends, over real gRPC, on the xDS shapes
Envoy Gateway sends (an EDS cluster per route rule, an HCM listener on RDS, a route table)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import envoy.config.cluster.v3.cluster_pb2 as cluster_pb2
import envoy.config.listener.v3.listener_components_pb2 as listener_components_pb2
import envoy.config.listener.v3.listener_pb2 as listener_pb2
import envoy.config.route.v3.route_components_pb2 as route_components_pb2
import envoy.config.route.v3.route_pb2 as route_pb2
import envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 as ext_proc_pb2
import envoy.extensions.filters.http.header_mutation.v3.header_mutation_pb2 as header_mutation_pb2
import envoy.extensions.filters.http.header_to_metadata.v3.header_to_metadata_pb2 as header_to_metadata_pb2
import envoy.extensions.filters.http.router.v3.router_pb2 as router_pb2
import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 as hcm_pb2
import grpc
import pytest

from kvgate.gateway import eg_extension as ext
from kvgate.gateway.envoy_config import _any

POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "smollm2", "namespace": "models", "generation": 3},
    "spec": {
        "selector": {"matchLabels": {"app": "smollm2"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "smollm2-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
    },
}
FAIL_OPEN = {
    **POOL,
    "metadata": {**POOL["metadata"], "uid": "6b1d0c2e-0000-4000-8000-000000000001"},
    "spec": {
        **POOL["spec"],
        "endpointPickerRef": {"name": "smollm2-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    },
}
POOL_CLUSTER = "httproute/models/smollm2/rule/0"
# what the API server holds: (namespace, HTTPRoute, rule index) -> that rule's backendRefs
RULES: dict[tuple[str, str, int], list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def stub() -> Any:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (ext.Extension(lambda ns, name, rule: RULES.get((ns, name, rule))).handler(),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def call(method: str, request: Any) -> Any:
        response = ext.MESSAGES[method.replace("Modify", "ModifyResponse")]
        fn = channel.unary_unary(
            f"/{ext.SERVICE}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return fn(request, timeout=10)

    yield call
    channel.close()
    server.stop(0)


def _resource(obj: dict[str, Any]) -> Any:
    return ext.MESSAGES["ExtensionResource"](unstructured_bytes=json.dumps(obj).encode())


def _eg_cluster(name: str) -> cluster_pb2.Cluster:
    c = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
    c.eds_cluster_config.service_name = name
    c.connect_timeout.seconds = 10
    return c


def _modified_pool_cluster(stub: Any, pool: dict[str, Any] = POOL) -> cluster_pb2.Cluster:
    req = ext.MESSAGES["PostClusterModifyRequest"](cluster=_eg_cluster(POOL_CLUSTER))
    req.post_cluster_context.backend_extension_resources.append(_resource(pool))
    return stub("PostClusterModify", req).cluster


def _listener() -> listener_pb2.Listener:
    hcm = hcm_pb2.HttpConnectionManager(stat_prefix="http-10080")
    hcm.rds.route_config_name = "default/kvgate/http"
    hcm.http_filters.append(
        hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router_pb2.Router()))
    )
    chain = listener_components_pb2.FilterChain(
        filters=[listener_components_pb2.Filter(name=ext.HCM, typed_config=_any(hcm))]
    )
    return listener_pb2.Listener(name="default/kvgate/http", filter_chains=[chain])


def _routes() -> route_pb2.RouteConfiguration:
    def route(name: str, cluster: str) -> route_components_pb2.Route:
        r = route_components_pb2.Route(name=name)
        r.match.prefix = "/"
        r.route.cluster = cluster
        return r

    vhost = route_components_pb2.VirtualHost(
        name="default/kvgate/http/*",
        domains=["*"],
        routes=[route("to-pool", POOL_CLUSTER), route("to-service", "httproute/default/web/rule/0")],
    )
    return route_pb2.RouteConfiguration(name="default/kvgate/http", virtual_hosts=[vhost])


def _hcm(listener: listener_pb2.Listener) -> hcm_pb2.HttpConnectionManager:
    hcm = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def test_a_pool_cluster_connects_where_the_epp_says(stub: Any) -> None:
    c = _modified_pool_cluster(stub)
    assert c.name == POOL_CLUSTER
    assert c.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert c.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert c.original_dst_lb_config.use_http_header
    assert c.original_dst_lb_config.http_header_name == "x-gateway-destination-endpoint"
    assert not c.HasField("eds_cluster_config") and c.connect_timeout.seconds == 10
    assert ext.Pool.from_cluster(c) == ext.Pool(
        "models", "smollm2", "smollm2-epp", 9002, "FailClose", target_port=8000
    )


def test_a_cluster_of_another_backend_comes_back_unchanged(stub: Any) -> None:
    req = ext.MESSAGES["PostClusterModifyRequest"](cluster=_eg_cluster("httproute/default/web/rule/0"))
    req.post_cluster_context.backend_extension_resources.append(
        _resource({"apiVersion": "example.com/v1", "kind": "Bucket", "metadata": {"name": "b"}})
    )
    assert stub("PostClusterModify", req).cluster == req.cluster


def test_translation_adds_the_epp_and_enables_its_filter_only_on_the_pools_routes(stub: Any) -> None:
    req = ext.MESSAGES["PostTranslateModifyRequest"]()
    req.clusters.extend([_modified_pool_cluster(stub), _eg_cluster("httproute/default/web/rule/0")])
    req.listeners.append(_listener())
    req.routes.append(_routes())
    resp = stub("PostTranslateModify", req)

    epp = {c.name: c for c in resp.clusters}["kvgate/epp/models/smollm2"]
    address = epp.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("smollm2-epp.models.svc.cluster.local", 9002)
    assert epp.type == cluster_pb2.Cluster.STRICT_DNS and epp.HasField("transport_socket")

    filters = _hcm(resp.listeners[0]).http_filters
    assert [f.name for f in filters] == [
        "envoy.filters.http.header_mutation/kvgate/strip-destination-endpoint",
        "envoy.filters.http.ext_proc/kvgate/models/smollm2",
        "envoy.filters.http.header_to_metadata/kvgate/destination-endpoint-served",
        "envoy.filters.http.router",
    ]
    # a client's x-gateway-destination-endpoint is removed before the EPP runs, on every route
    strip = header_mutation_pb2.HeaderMutation()
    assert not filters[0].disabled and filters[0].typed_config.Unpack(strip)
    assert [m.remove for m in strip.mutations.request_mutations] == ["x-gateway-destination-endpoint"]
    assert filters[1].disabled
    proc = ext_proc_pb2.ExternalProcessor()
    assert filters[1].typed_config.Unpack(proc)
    assert proc.grpc_service.envoy_grpc.cluster_name == "kvgate/epp/models/smollm2"
    assert not proc.failure_mode_allow  # FailClose
    # GIE: the response headers (not the body) go to the EPP with the served endpoint, which the
    # filter after the EPP copies from the header it set into envoy.lb metadata
    mode = proc.processing_mode
    assert (mode.response_header_mode, mode.response_body_mode) == (mode.SEND, mode.NONE)
    assert "envoy.lb" in proc.metadata_options.forwarding_namespaces.untyped
    served = header_to_metadata_pb2.Config()
    assert not filters[2].disabled and filters[2].typed_config.Unpack(served)
    (rule,) = served.request_rules
    assert rule.header == "x-gateway-destination-endpoint" and not rule.remove
    kv = rule.on_header_present
    assert (kv.metadata_namespace, kv.key) == ("envoy.lb", "x-gateway-destination-endpoint-served")

    to_pool, to_service = resp.routes[0].virtual_hosts[0].routes
    assert list(to_pool.typed_per_filter_config) == ["envoy.filters.http.ext_proc/kvgate/models/smollm2"]
    config = route_components_pb2.FilterConfig()
    assert to_pool.typed_per_filter_config["envoy.filters.http.ext_proc/kvgate/models/smollm2"].Unpack(config)
    assert not config.disabled
    per_route = ext_proc_pb2.ExtProcPerRoute()
    assert config.config.Unpack(per_route) and per_route.HasField("overrides")  # Envoy requires one
    assert not to_service.typed_per_filter_config


def test_listeners_without_a_route_to_a_pool_get_no_filter(stub: Any) -> None:
    req = ext.MESSAGES["PostTranslateModifyRequest"]()
    req.clusters.append(_modified_pool_cluster(stub))
    other = _listener()
    hcm = _hcm(other)
    hcm.rds.route_config_name = "envoy-gateway-proxy-ready"
    other.filter_chains[0].filters[0].typed_config.CopyFrom(_any(hcm))
    req.listeners.extend([_listener(), other])
    req.routes.append(_routes())
    resp = stub("PostTranslateModify", req)
    assert len(_hcm(resp.listeners[0]).http_filters) == 4
    assert [f.name for f in _hcm(resp.listeners[1]).http_filters] == ["envoy.filters.http.router"]


def test_translation_is_idempotent(stub: Any) -> None:
    req = ext.MESSAGES["PostTranslateModifyRequest"]()
    req.clusters.append(_modified_pool_cluster(stub))
    req.listeners.append(_listener())
    req.routes.append(_routes())
    once = stub("PostTranslateModify", req)
    again = ext.MESSAGES["PostTranslateModifyRequest"](
        clusters=once.clusters, listeners=once.listeners, routes=once.routes
    )
    twice = stub("PostTranslateModify", again)
    assert [c.name for c in twice.clusters] == [c.name for c in once.clusters]
    assert len(_hcm(twice.listeners[0]).http_filters) == 4


def test_translation_without_pools_changes_nothing(stub: Any) -> None:
    req = ext.MESSAGES["PostTranslateModifyRequest"]()
    req.clusters.append(_eg_cluster("httproute/default/web/rule/0"))
    req.listeners.append(_listener())
    req.routes.append(_routes())
    resp = stub("PostTranslateModify", req)
    assert list(resp.clusters) == list(req.clusters)
    assert list(resp.listeners) == list(req.listeners)
    assert list(resp.routes) == list(req.routes)


def test_a_malformed_pool_is_an_error_not_a_crash(stub: Any) -> None:
    req = ext.MESSAGES["PostClusterModifyRequest"](cluster=_eg_cluster(POOL_CLUSTER))
    broken = {**POOL, "spec": {"selector": {}, "targetPorts": []}}  # no endpointPickerRef
    req.post_cluster_context.backend_extension_resources.append(_resource(broken))
    with pytest.raises(grpc.RpcError) as err:
        stub("PostClusterModify", req)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    # the server still answers afterwards
    assert _modified_pool_cluster(stub).type == cluster_pb2.Cluster.ORIGINAL_DST


def _route_to_pool(accepted: bool) -> dict[str, Any]:
    return {
        "metadata": {"name": "smollm2", "namespace": "models"},
        "spec": {
            "parentRefs": [{"name": "kvgate", "namespace": "default"}],
            "rules": [
                {"backendRefs": [{"group": ext.POOL_GROUP, "kind": "InferencePool", "name": "smollm2"}]}
            ],
        },
        "status": {
            "parents": [
                {
                    "parentRef": {"name": "kvgate", "namespace": "default"},
                    "controllerName": ext.EG_CONTROLLER,
                    "conditions": [{"type": "Accepted", "status": "True" if accepted else "False"}],
                }
            ]
        },
    }


GATEWAYS = {("default", "kvgate"): {"spec": {"gatewayClassName": "kvgate"}}}
CLASSES = {"kvgate": {"spec": {"controllerName": ext.EG_CONTROLLER}}}


def test_pool_status_names_each_gateway_that_routes_to_it() -> None:
    parents = ext.pool_parents(
        POOL, [_route_to_pool(True)], GATEWAYS, CLASSES, {("models", "smollm2-epp")}, "2026-12-06T00:00:00Z"
    )
    assert [p["parentRef"] for p in parents] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "default", "name": "kvgate"}
    ]
    conditions = {c["type"]: c for c in parents[0]["conditions"]}
    assert conditions["Accepted"]["status"] == "True"
    assert conditions["ResolvedRefs"]["status"] == "True"
    assert conditions["Accepted"]["observedGeneration"] == 3


def test_pool_status_says_why_when_not_accepted_or_the_epp_is_missing() -> None:
    parents = ext.pool_parents(
        POOL, [_route_to_pool(False)], GATEWAYS, CLASSES, set(), "2026-12-06T00:00:00Z"
    )
    conditions = {c["type"]: c for c in parents[0]["conditions"]}
    assert (conditions["Accepted"]["status"], conditions["Accepted"]["reason"]) == (
        "False",
        "HTTPRouteNotAccepted",
    )
    assert (conditions["ResolvedRefs"]["status"], conditions["ResolvedRefs"]["reason"]) == (
        "False",
        "InvalidExtensionRef",
    )


def test_pool_status_ignores_gateways_of_other_implementations_and_other_pools() -> None:
    other_class = {"kvgate": {"spec": {"controllerName": "example.com/other"}}}
    assert ext.pool_parents(POOL, [_route_to_pool(True)], GATEWAYS, other_class, set(), "t") == []
    other_pool = {**POOL, "metadata": {**POOL["metadata"], "name": "another"}}
    assert ext.pool_parents(other_pool, [_route_to_pool(True)], GATEWAYS, CLASSES, set(), "t") == []


def test_pool_status_keeps_transition_times_while_nothing_changes() -> None:
    first = ext.pool_parents(POOL, [_route_to_pool(True)], GATEWAYS, CLASSES, set(), "2026-12-06T00:00:00Z")
    pool = {**POOL, "status": {"parents": first}}
    second = ext.pool_parents(pool, [_route_to_pool(True)], GATEWAYS, CLASSES, set(), "2026-12-06T01:00:00Z")
    assert second == first
    third = ext.pool_parents(
        pool, [_route_to_pool(True)], GATEWAYS, CLASSES, {("models", "smollm2-epp")}, "2026-12-06T02:00:00Z"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in third[0]["conditions"]}
    assert times == {"Accepted": "2026-12-06T00:00:00Z", "ResolvedRefs": "2026-12-06T02:00:00Z"}


def test_a_rule_split_between_two_pools_is_a_weighted_choice_with_only_the_chosen_pools_epp(
    stub: Any,
) -> None:
    canary = {**POOL, "metadata": {"name": "canary", "namespace": "models"}}
    canary["spec"] = {**POOL["spec"], "endpointPickerRef": {"name": "canary-epp", "port": {"number": 9002}}}
    # what Envoy Gateway (v1.9) sends for a rule with backendRefs smollm2 (weight 70) and canary
    # (30): one EDS cluster for the rule, no endpoints, the pools in backendRef order, no weights
    # (those are in its EDS localities); the weights come from the HTTPRoute
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool"}
    RULES[("models", "smollm2", 0)] = [
        {**pool_ref, "name": "smollm2", "weight": 70},
        {**pool_ref, "name": "canary", "weight": 30},
        {**pool_ref, "name": "dark", "weight": 0},  # no traffic: Envoy Gateway leaves it out
    ]
    cluster = _eg_cluster(POOL_CLUSTER)
    req = ext.MESSAGES["PostClusterModifyRequest"](cluster=cluster)
    req.post_cluster_context.backend_extension_resources.extend([_resource(POOL), _resource(canary)])
    modified = stub("PostClusterModify", req).cluster

    translate = ext.MESSAGES["PostTranslateModifyRequest"](
        clusters=[modified], listeners=[_listener()], routes=[_routes()]
    )
    resp = stub("PostTranslateModify", translate)
    by_name = {c.name: c for c in resp.clusters}
    for key, epp in (("models/smollm2", "smollm2-epp"), ("models/canary", "canary-epp")):
        one = by_name[f"{POOL_CLUSTER}/pool/{key}"]
        assert one.type == cluster_pb2.Cluster.ORIGINAL_DST and ext.Pool.from_cluster(one).epp == epp
        assert f"kvgate/epp/{key}" in by_name
    to_pool = resp.routes[0].virtual_hosts[0].routes[0]
    assert not to_pool.route.cluster and not to_pool.typed_per_filter_config
    chosen = {
        c.name: (c.weight.value, list(c.typed_per_filter_config))
        for c in to_pool.route.weighted_clusters.clusters
    }
    assert chosen == {
        f"{POOL_CLUSTER}/pool/models/smollm2": (70, ["envoy.filters.http.ext_proc/kvgate/models/smollm2"]),
        f"{POOL_CLUSTER}/pool/models/canary": (30, ["envoy.filters.http.ext_proc/kvgate/models/canary"]),
    }
    names = [f.name for f in _hcm(resp.listeners[0]).http_filters]
    assert "envoy.filters.http.ext_proc/kvgate/models/canary" in names
    # translated again (Envoy Gateway may resend what it got back): the same result
    again = stub("PostTranslateModify", ext.MESSAGES["PostTranslateModifyRequest"](
        clusters=list(resp.clusters), listeners=list(resp.listeners), routes=list(resp.routes)))  # fmt: skip
    assert sorted(c.name for c in again.clusters) == sorted(by_name)
    assert again.routes[0] == resp.routes[0]


def test_a_rule_mixing_a_pool_with_another_backend_is_not_split(stub: Any) -> None:
    canary = {**POOL, "metadata": {"name": "canary", "namespace": "models"}}
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool"}
    for rule, refs in enumerate(
        [
            [{**pool_ref, "name": "smollm2"}, {"kind": "Service", "name": "plain", "port": 80}],
            [{**pool_ref, "name": "smollm2"}, {**pool_ref, "name": "elsewhere"}],  # not among those given
        ]
    ):
        RULES[("mixed", "route", rule)] = refs
        req = ext.MESSAGES["PostClusterModifyRequest"](
            cluster=_eg_cluster(f"httproute/mixed/route/rule/{rule}")
        )
        req.post_cluster_context.backend_extension_resources.extend([_resource(POOL), _resource(canary)])
        modified = stub("PostClusterModify", req).cluster
        assert ext.SPLIT_KEY not in modified.metadata.filter_metadata
        assert ext.Pool.from_cluster(modified).name == "smollm2"
    # a route the API server cannot give (gone, or no access): one pool, never a guessed split
    req = ext.MESSAGES["PostClusterModifyRequest"](cluster=_eg_cluster("httproute/mixed/unknown/rule/0"))
    req.post_cluster_context.backend_extension_resources.extend([_resource(POOL), _resource(canary)])
    assert ext.SPLIT_KEY not in stub("PostClusterModify", req).cluster.metadata.filter_metadata


def test_a_pool_of_h2c_model_servers_gets_http2_to_its_endpoints(stub: Any) -> None:
    h2c = {**POOL, "spec": {**POOL["spec"], "appProtocol": "kubernetes.io/h2c"}}
    options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    for obj, http2 in ((h2c, True), (POOL, False)):
        req = ext.MESSAGES["PostClusterModifyRequest"](cluster=_eg_cluster(POOL_CLUSTER))
        req.post_cluster_context.backend_extension_resources.append(_resource(obj))
        c = stub("PostClusterModify", req).cluster
        assert (options in c.typed_extension_protocol_options) is http2
        assert ext.Pool.from_cluster(c).app_protocol == ("kubernetes.io/h2c" if http2 else "http")


def test_a_fail_open_pool_is_its_endpoints_chosen_by_the_epp_or_round_robin(stub: Any) -> None:
    """FailOpen: the cluster is the pool's endpoints by DNS (its shadow Service) under the
    override-host policy, and its ext_proc filter lets a request through when no EPP answers:
    round robin over the pool, never an ORIGINAL_DST connect back into the proxy."""
    import envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2 as override_host_pb2

    pool = ext.Pool.from_object(FAIL_OPEN)
    assert pool.fails_open and pool.shadow_service.startswith("smollm2-ip-")
    c = _modified_pool_cluster(stub, FAIL_OPEN)
    assert c.name == POOL_CLUSTER and c.type == cluster_pb2.Cluster.STRICT_DNS
    assert not c.HasField("original_dst_lb_config") and not c.HasField("eds_cluster_config")
    (endpoint,) = c.load_assignment.endpoints[0].lb_endpoints
    address = endpoint.endpoint.address.socket_address
    assert (address.address, address.port_value) == (pool.shadow_host, 8000)
    assert pool.shadow_host == f"{pool.shadow_service}.models.svc.cluster.local"
    (policy,) = c.load_balancing_policy.policies
    override = override_host_pb2.OverrideHost()
    assert policy.typed_extension_config.typed_config.Unpack(override)
    assert [s.header for s in override.override_host_sources if s.header] == [
        "x-gateway-destination-endpoint"
    ]
    assert c.connect_timeout.seconds == 10  # Envoy Gateway's settings stay
    assert ext.Pool.from_cluster(c) == pool

    req = ext.MESSAGES["PostTranslateModifyRequest"]()
    req.clusters.append(c)
    req.listeners.append(_listener())
    req.routes.append(_routes())
    filters = _hcm(stub("PostTranslateModify", req).listeners[0]).http_filters
    proc = ext_proc_pb2.ExternalProcessor()
    assert filters[1].typed_config.Unpack(proc) and proc.failure_mode_allow


def test_a_fail_open_pool_without_a_port_fails_closed() -> None:
    no_port = {**FAIL_OPEN, "spec": {**FAIL_OPEN["spec"], "targetPorts": []}}
    pool = ext.Pool.from_object(no_port)
    assert not pool.fails_open and ext.shadow_service(no_port) is None
    c = ext.pool_cluster(_eg_cluster(POOL_CLUSTER), pool)
    assert c.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert not ext._pool_ext_proc(pool).failure_mode_allow


def test_the_shadow_service_is_headless_selects_the_pool_and_is_owned_by_it() -> None:
    svc = ext.shadow_service(FAIL_OPEN)
    assert svc is not None
    assert svc["metadata"]["name"] == ext.Pool.from_object(FAIL_OPEN).shadow_service
    assert svc["metadata"]["namespace"] == "models"
    (owner,) = svc["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "InferencePool",
        "smollm2",
        FAIL_OPEN["metadata"]["uid"],
    )
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"app": "smollm2"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000}]
    assert ext.shadow_service(POOL) is None  # FailClose: none
    # a pool with no EPP reference (GIE's InferencePoolMissingEPPRef) is no error: the status
    # loop goes on to write every pool's status (a KeyError here stopped it for all of them)
    missing = {**FAIL_OPEN, "spec": {k: v for k, v in FAIL_OPEN["spec"].items() if k != "endpointPickerRef"}}
    assert ext.shadow_service(missing) is None
    # names are DNS labels, distinct per namespace, from any pool name
    dotted = ext.Pool("a", "9.model.v2", "e", 1, "FailOpen", target_port=1).shadow_service
    other = ext.Pool("b", "9.model.v2", "e", 1, "FailOpen", target_port=1).shadow_service
    import re

    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", dotted) and dotted != other
    long = ext.Pool("a", "x" * 253, "e", 1, "FailOpen", target_port=1).shadow_service
    assert len(long) <= 63


def test_pool_status_makes_the_shadow_service_and_puts_a_drifted_one_back() -> None:
    import asyncio

    import httpx

    calls: list[tuple[str, str, dict[str, Any]]] = []

    def api(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, json.loads(request.content or b"{}")))
        return httpx.Response(201 if request.method == "POST" else 200, json={})

    status = ext.PoolStatus(httpx.AsyncClient(transport=httpx.MockTransport(api), base_url="http://api"))
    want = ext.shadow_service(FAIL_OPEN)
    assert want is not None
    key = (want["metadata"]["namespace"], want["metadata"]["name"])
    defaulted = {**want, "spec": {**want["spec"], "ports": [{**want["spec"]["ports"][0], "protocol": "TCP"}]}}
    drifted = {**want, "spec": {**want["spec"], "selector": {"app": "other"}}}

    async def keep(services: dict[Any, Any], pool: dict[str, Any] = FAIL_OPEN) -> None:
        await status._keep_shadow(pool, services)

    asyncio.run(keep({}))
    asyncio.run(keep({key: defaulted}))  # as the API server keeps it: nothing to do
    asyncio.run(keep({key: drifted}))
    asyncio.run(keep({}, POOL))  # FailClose: none
    assert [(m, p) for m, p, _ in calls] == [
        ("POST", "/api/v1/namespaces/models/services"),
        ("PATCH", f"/api/v1/namespaces/models/services/{key[1]}"),
    ]
    assert calls[0][2] == want
    assert calls[1][2] == {"spec": {"selector": {"app": "smollm2"}, "ports": want["spec"]["ports"]}}

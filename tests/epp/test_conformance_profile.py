"""The `conformance` profile: GIE's conformance suite names the pods a request may go to and
reads back the endpoint the gateway says served it (its lightweight EPP's two behaviours)."""

from __future__ import annotations

import json
import time
from collections import Counter

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.extproc import EndpointPickerHandler, _Exchange
from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector
from tests.epp.test_extproc import body_msg, headers_msg, set_headers

ADDRS = ["10.0.0.1:3000", "10.0.0.2:3000", "10.0.0.3:3000"]
BODY = json.dumps({"model": "conformance-fake-model", "prompt": "San Francisco"}).encode()


def _handler(profile: str, report: bool) -> EndpointPickerHandler:
    ds = Datastore()
    ds.set_endpoints([Endpoint(a) for a in ADDRS])
    for a in ADDRS:
        ds.update_metrics(a, EndpointMetrics(updated_at=time.monotonic()))
    cfg = load_config(None, profile)
    director = Director(ds, build_profiles(cfg)[0], saturation_detector(cfg))
    return EndpointPickerHandler(director, report_served_endpoint=report)


def _picks(handler: EndpointPickerHandler, selection: str | None, n: int = 30) -> Counter[str]:
    got: Counter[str] = Counter()
    for _ in range(n):
        x = _Exchange()
        headers = {":path": "/v1/completions"}
        if selection is not None:
            headers["test-epp-endpoint-selection"] = selection
        handler.handle(x, headers_msg(headers))
        (first, *_) = handler.handle(x, body_msg(BODY, True))
        got[set_headers(first)["x-gateway-destination-endpoint"]] += 1
    return got


def test_the_header_names_the_endpoints_by_address_or_ip() -> None:
    handler = _handler("conformance", True)
    assert set(_picks(handler, "10.0.0.3")) == {"10.0.0.3:3000"}
    assert set(_picks(handler, "10.0.0.1:3000, 10.0.0.2")) == {"10.0.0.1:3000", "10.0.0.2:3000"}
    # no header, or nothing it names in the pool: every endpoint, in turn
    assert set(_picks(handler, None)) == set(ADDRS)
    assert set(_picks(handler, "10.9.9.9,10.0.0.1:9999")) == set(ADDRS)


def test_no_other_built_in_profile_lets_a_client_choose_its_endpoint() -> None:
    for profile in ("precise-prefix", "default", "round-robin", "random"):
        assert len(_picks(_handler(profile, False), "10.0.0.3", n=40)) > 1, profile


def _response_headers(handler: EndpointPickerHandler, served: str | None) -> dict[str, str]:
    x = _Exchange()
    handler.handle(x, headers_msg({":path": "/v1/completions"}))
    handler.handle(x, body_msg(BODY, True))
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm))
    if served is not None:
        lb = struct_pb2.Struct()
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    (resp,) = handler.handle(x, msg)
    muts = resp.response_headers.response.header_mutation.set_headers
    return {h.header.key: h.header.raw_value.decode() for h in muts}


def test_the_served_endpoint_is_echoed_in_the_conformance_header() -> None:
    handler = _handler("conformance", True)
    assert (
        _response_headers(handler, "10.0.0.2:3000")["x-conformance-test-served-endpoint"] == "10.0.0.2:3000"
    )
    assert (
        _response_headers(handler, None)["x-conformance-test-served-endpoint"]
        == "fail: missing envoy lb metadata"
    )
    assert "x-conformance-test-served-endpoint" not in _response_headers(
        _handler("round-robin", False), "10.0.0.2:3000"
    )


def test_response_headers_alone_leave_in_flight_counting_to_the_stream() -> None:
    # Envoy Gateway sends the response headers but not the body: the stream closes while the
    # engine still streams, so in-flight counts must not turn exact on the headers alone
    handler = _handler("conformance", True)
    _response_headers(handler, "10.0.0.2:3000")
    assert not handler.director.datastore.inflight_tracked

"""The ext_proc translator, message by message (the Envoy side is exercised in e2e/)."""

from __future__ import annotations

import json
import time

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.extproc import MAX_CHUNK, EndpointPickerHandler, ModelRewriter, _Exchange
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector

ADDRS = ["10.0.0.1:8000", "10.0.0.2:8000"]


@pytest.fixture
def handler(char_tokenizer) -> EndpointPickerHandler:
    ds = Datastore()
    ds.set_endpoints([Endpoint(a) for a in ADDRS])
    for a in ADDRS:
        ds.update_metrics(a, EndpointMetrics(updated_at=time.monotonic()))
    cfg = load_config(None, "precise-prefix")
    director = Director(ds, build_profiles(cfg)[0], saturation_detector(cfg))
    return EndpointPickerHandler(director, EppMetrics(ds), char_tokenizer, {"batch": -1})


def headers_msg(
    headers: dict[str, str], eos: bool = False, subset: list[str] | None = None
) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=eos))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def body_msg(data: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def set_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    muts = resp.request_headers.response.header_mutation.set_headers
    return {h.header.key: h.header.raw_value.decode() for h in muts}


def run(handler, *msgs) -> tuple[_Exchange, list[ep.ProcessingResponse]]:
    x = _Exchange()
    out: list[ep.ProcessingResponse] = []
    for m in msgs:
        out += handler.handle(x, m)
    return x, out


def test_body_is_buffered_then_headers_metadata_and_body_are_sent(handler) -> None:
    payload = json.dumps({"model": "m", "prompt": "hi"}).encode()
    x, out = run(
        handler,
        headers_msg({":path": "/v1/completions", "x-request-id": "abc"}),
        body_msg(payload[:5], False),
    )
    assert out == []  # nothing until end of stream
    out = handler.handle(x, body_msg(payload[5:], True))
    first = out[0]
    assert first.request_headers.response.clear_route_cache
    h = set_headers(first)
    assert h["x-gateway-destination-endpoint"] in ADDRS
    assert h["content-length"] == str(len(payload))
    assert "x-request-id" not in h  # the client's id is kept as is
    lb = (
        first.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )
    assert lb == h["x-gateway-destination-endpoint"]
    assert [r.request_body.response.body_mutation.streamed_response.body for r in out[1:]] == [payload]
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_large_body_is_restreamed_in_chunks(handler) -> None:
    payload = json.dumps({"model": "m", "prompt": "x" * 150_000}).encode()
    _, out = run(handler, headers_msg({}), body_msg(payload, True))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert len(chunks) == 3 and all(len(c.body) <= MAX_CHUNK for c in chunks)
    assert b"".join(c.body for c in chunks) == payload
    assert [c.end_of_stream for c in chunks] == [False, False, True]


def test_request_without_body_is_picked_at_once_and_gets_an_id(handler) -> None:
    _, out = run(handler, headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True))
    assert len(out) == 1
    h = set_headers(out[0])
    assert h["x-gateway-destination-endpoint"] in ADDRS and "content-length" not in h
    assert len(h["x-request-id"]) == 36  # generated uuid


@pytest.mark.parametrize("raw", [b"", b"{", b'{"prompt": "x"}', b'{"model": ""}', b'"str"'])
def test_bad_bodies_get_an_immediate_400(handler, raw) -> None:
    _, out = run(handler, headers_msg({"x-request-id": "r9"}), body_msg(raw, True))
    (resp,) = out
    imm = resp.immediate_response
    assert imm.status.code == 400
    err = json.loads(imm.body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400


def test_subset_hint(handler) -> None:
    payload = b'{"model": "m", "prompt": "p"}'
    _, out = run(handler, headers_msg({}, subset=[ADDRS[1]]), body_msg(payload, True))
    assert set_headers(out[0])["x-gateway-destination-endpoint"] == ADDRS[1]
    for subset in ([], ["192.168.9.9:1"]):
        _, out = run(handler, headers_msg({}, subset=subset), body_msg(payload, True))
        assert out[0].immediate_response.status.code == 503


def test_fallbacks_go_in_metadata_primary_in_header(handler) -> None:
    handler.director.profile.picker.max_num_of_endpoints = 2
    _, out = run(handler, headers_msg({}), body_msg(b'{"model": "m", "prompt": "p"}', True))
    primary = set_headers(out[0])["x-gateway-destination-endpoint"]
    lb = (
        out[0]
        .dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )
    assert lb.split(",")[0] == primary and sorted(lb.split(",")) == sorted(ADDRS)


def test_sheddable_objective_is_429_when_saturated(handler) -> None:
    for s in handler.director.datastore.all():
        s.metrics.waiting = 10
    body = b'{"model": "m", "prompt": "p"}'
    _, out = run(handler, headers_msg({"x-gateway-inference-objective": "batch"}), body_msg(body, True))
    assert out[0].immediate_response.status.code == 429
    _, out = run(handler, headers_msg({"x-gateway-inference-objective": "interactive"}), body_msg(body, True))
    assert out[0].HasField("request_headers")


def test_model_rewrite_round_trip(handler) -> None:
    x, out = run(
        handler,
        headers_msg({"x-gateway-model-name-rewrite": "real-model"}),
        body_msg(b'{"model": "alias", "prompt": "p"}', True),
    )
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])
    assert json.loads(sent)["model"] == "real-model"
    assert set_headers(out[0])["content-length"] == str(len(sent))
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    resp = handler.handle(x, ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm)))
    assert list(resp[0].response_headers.response.header_mutation.remove_headers) == ["content-length"]
    data = b'{"id":"1","model":"real-model","x":1}'
    back = b""
    for i in range(0, len(data), 7):  # split the needle across chunks
        last = i + 7 >= len(data)
        r = handler.handle(
            x, ep.ProcessingRequest(response_body=ep.HttpBody(body=data[i : i + 7], end_of_stream=last))
        )
        back += r[0].response_body.response.body_mutation.streamed_response.body
    assert json.loads(back)["model"] == "alias"


def test_rewriter_handles_sse_and_spaced_json() -> None:
    rw = ModelRewriter("big", "small")
    out = rw.feed(b'data: {"model": "big"}\n\ndata: {"model":"b', False) + rw.feed(b'ig"}\n\n', True)
    assert out == b'data: {"model": "small"}\n\ndata: {"model":"small"}\n\n'


def test_response_completion_releases_inflight_and_counts_errors(handler) -> None:
    x, out = run(handler, headers_msg({}), body_msg(b'{"model": "m", "prompt": "p"}', True))
    target = set_headers(out[0])["x-gateway-destination-endpoint"]
    state = handler.director.datastore.get(target)
    assert state.inflight == 1
    assert not handler.director.datastore.inflight_tracked  # no response phase seen yet
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"503")])
    handler.handle(x, ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm)))
    # the headers alone may come without the body (Envoy Gateway's filter): not exact yet
    assert not handler.director.datastore.inflight_tracked
    out = handler.handle(x, ep.ProcessingRequest(response_body=ep.HttpBody(body=b"oops", end_of_stream=True)))
    assert handler.director.datastore.inflight_tracked  # Envoy sends the body: in-flight counts are exact
    assert out[0].response_body.response.body_mutation.streamed_response.end_of_stream
    assert state.inflight == 0
    handler.finish(x)  # stream teardown after a normal end must not double-release
    assert state.inflight == 0
    text = handler.metrics.registry.get_sample_value(
        "inference_pool_endpoint_error_total", {"name": "local", "endpoint": target}
    )
    assert text == 1.0


def test_trailers_end_a_body_without_end_of_stream(handler) -> None:
    x, out = run(handler, headers_msg({}), body_msg(b'{"model": "m", "prompt": "p"}', False))
    assert out == []
    out = handler.handle(x, ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    assert out[0].HasField("request_headers") and out[-1].HasField("request_trailers")

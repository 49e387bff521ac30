"""Tracing through the whole path: `kvgate up --simulate --otlp-endpoint URL` with a real OTLP
collector on loopback; a client's `traceparent` must come back as one trace holding the EPP's
pick and the engine's request, linked client -> pick -> engine."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, start_up, stop_up
from kvgate.testing.otlp import Collector, ReceivedSpan, otlp_collector

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, Collector]]:
    with otlp_collector() as collector:
        up = start_up(
            tmp_path_factory.mktemp("traced"),
            "--simulate",
            "--engines",
            "2",
            "--otlp-endpoint",
            collector.url,
            "--quiet",
        )
        try:
            # ready means Envoy sees the EPPs healthy: the first request is picked (no warm-up)
            up.wait_for_line(r"^curl ")
            yield up, collector
        finally:
            stop_up(up)


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_trace_holds_the_pick_and_the_engine_request(
    traced: tuple[UpProcess, Collector], stream: bool
) -> None:
    up, collector = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "default", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4}
    r = httpx.post(
        up.stack["gateway_url"] + "/v1/chat/completions",
        json={**body, "stream": stream},
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=30,
    )
    assert r.status_code == 200, r.text

    def both() -> bool:
        names = {s.name for s in collector.trace(trace_id)}
        return {"kvgate.epp.pick", "kvgate.engine.request"} <= names

    try:
        eventually(both, 20, "the EPP's and the engine's spans in the client's trace")
    except Exception:
        seen = [(s.service, s.name, s.trace_id[:8]) for s in collector.spans]
        raise AssertionError(f"trace {trace_id[:8]}; every span received: {seen}") from None
    spans = collector.trace(trace_id)
    (pick,) = [s for s in spans if s.name == "kvgate.epp.pick"]
    (request,) = [s for s in spans if s.name == "kvgate.engine.request"]
    assert pick.service == "kvgate-epp" and request.service == "kvgate-engine"
    assert pick.parent_span_id == client_span  # the client's span is the pick's parent
    assert request.parent_span_id == pick.span_id  # and the pick is the engine request's
    assert pick.attributes["kvgate.pick.status"] == 200
    assert pick.attributes["kvgate.pick.candidates"] == 2
    assert "http://" + pick.attributes["kvgate.pick.endpoint"] in up.stack["engine_urls"]
    assert pick.attributes["kvgate.profile"] == "precise-prefix"
    assert request.attributes["http.response.status_code"] == 200
    if stream:
        assert "first_chunk" in request.events
    else:
        assert request.attributes["gen_ai.usage.output_tokens"] == 4


def test_without_a_traceparent_each_request_gets_its_own_trace(traced: tuple[UpProcess, Collector]) -> None:
    up, collector = traced
    r = httpx.post(
        up.stack["gateway_url"] + "/v1/completions",
        json={"model": "default", "prompt": "untraced client", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200
    response_id = r.json()["id"]

    def mine() -> list[ReceivedSpan]:
        return [s for s in collector.spans if s.attributes.get("gen_ai.response.id") == response_id]

    eventually(mine, 20, "the engine's span of this request")
    (request,) = mine()
    eventually(lambda: collector.trace(request.trace_id) != [request], 20, "the pick in the same trace")
    (pick,) = [s for s in collector.trace(request.trace_id) if s.name == "kvgate.epp.pick"]
    assert pick.parent_span_id == "" and request.parent_span_id == pick.span_id

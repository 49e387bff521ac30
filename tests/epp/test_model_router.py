"""The model router's table and protocol logic against real simulated engines (no Envoy: the
handler is driven message by message, as Envoy would)."""

from __future__ import annotations

import json
import logging

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvgate.epp.model_router import (
    MODEL_NAME_HEADER,
    POOL_HEADER,
    ModelRouterHandler,
    ModelTable,
    PoolSource,
    _Exchange,
)
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-engines")
    # two pools, and a name both serve (an alias): the first pool given must win it
    started = [
        harness.start_engine(
            logs,
            "--served-model-name",
            "alpha",
            "shared",
            "--enable-lora",
            "--lora-modules",
            f"alpha-sql={logs}",
        ),
        harness.start_engine(logs, "--served-model-name", "beta", "shared"),
    ]
    try:
        for e in started:
            e.wait_ready()
        yield started
    finally:
        harness.stop_all(*(e.proc for e in started))


def _headers(method: str, path: str, end: bool = False) -> ep.ProcessingRequest:
    hs = [
        base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
    ]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs), end_of_stream=end)
    )


def _body(data: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


async def _send(handler: ModelRouterHandler, *messages: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
    x = _Exchange()
    out: list[ep.ProcessingResponse] = []
    for msg in messages:
        out = await handler.handle(x, msg)
        if out and out[0].HasField("immediate_response"):
            break
    return out


def _set_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    mutation = resp.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_table_learns_models_and_adapters_first_pool_wins(engines, caplog) -> None:
    a, b = engines
    table = ModelTable(
        [
            PoolSource("alpha", (a.address,)),
            PoolSource("beta", (b.address,)),
            PoolSource("gamma", ("127.0.0.1:1",)),
        ]
    )
    # before any answer: each pool's own name routes to it
    assert table.pool_for("gamma") == "gamma" and table.pool_for("alpha-sql") is None
    with caplog.at_level(logging.WARNING, "kvgate.epp.model_router"):
        await table.refresh()
    assert table.pool_for("alpha") == "alpha" and table.pool_for("alpha-sql") == "alpha"
    assert table.pool_for("beta") == "beta" and table.pool_for("shared") == "alpha"
    assert table.pool_for("gamma") == "gamma"  # its engine never answered: still its name
    assert "served by pools alpha and beta" in caplog.text
    ids = [c["id"] for c in table.cards()]
    assert sorted(ids) == ["alpha", "alpha-sql", "beta", "gamma", "shared"]
    assert table.card("alpha-sql")["parent"] == "alpha"
    await table.close()


async def test_handler_routes_refuses_and_lists(engines) -> None:
    a, b = engines
    table = ModelTable([PoolSource("alpha", (a.address,)), PoolSource("beta", (b.address,))])
    await table.refresh()
    handler = ModelRouterHandler(table, max_body_bytes=1 << 20)

    body = json.dumps({"model": "beta", "prompt": "x" * 100_000}).encode()  # parsed off the loop
    out = await _send(
        handler, _headers("POST", "/v1/completions"), _body(body[:70_000], end=False), _body(body[70_000:])
    )
    hdrs = _set_headers(out[0])
    assert hdrs[POOL_HEADER] == "beta" and hdrs[MODEL_NAME_HEADER] == "beta"
    assert out[0].request_headers.response.clear_route_cache
    assert b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:]) == body

    # a body ended by trailers
    small = json.dumps({"model": "alpha-sql", "prompt": "hi"}).encode()
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    out = await _send(handler, _headers("POST", "/v1/completions"), _body(small, end=False), trailers)
    assert _set_headers(out[0])[POOL_HEADER] == "alpha" and out[-1].HasField("request_trailers")

    out = await _send(handler, _headers("POST", "/v1/completions"), _body(b'{"model": "nope"}'))
    reply = out[0].immediate_response
    assert reply.status.code == 404 and json.loads(reply.body)["error"]["type"] == "NotFoundError"

    out = await _send(
        handler, _headers("POST", "/v1/completions"), _body(b"x" * (1 << 20), end=False), _body(b"x")
    )
    assert out[0].immediate_response.status.code == 413

    out = await _send(handler, _headers("GET", "/v1/models?limit=1", end=True))
    listed = json.loads(out[0].immediate_response.body)
    assert {m["id"] for m in listed["data"]} >= {"alpha", "beta", "alpha-sql", "shared"}
    out = await _send(handler, _headers("GET", "/v1/models/alpha-sql", end=True))
    assert json.loads(out[0].immediate_response.body)["id"] == "alpha-sql"

    # bodyless and not the model list: passed on with any client-sent pool header removed
    out = await _send(handler, _headers("GET", "/v1/other", end=True))
    removed = out[0].request_headers.response.header_mutation.remove_headers
    assert POOL_HEADER in removed and out[0].request_headers.response.clear_route_cache
    await table.close()


def test_cli_refuses_bad_pools() -> None:
    for bad in ("alpha", "alpha=", "alpha=host", "=127.0.0.1:1"):
        out = harness.run_kvgate("router", "serve", "--pool", bad)
        assert out.returncode == 2 and "NAME=HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    out = harness.run_kvgate("router", "serve", "--pool", "a=127.0.0.1:1", "--pool", "a=127.0.0.1:2")
    assert out.returncode == 2 and "unique" in out.stderr

"""The model router's table and protocol logic against real simulated engines (no Envoy: the
handler is driven message by message, as Envoy would)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvgate.gateway.model_router import (
    MISS_REFRESH_GAP_S,
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
    with caplog.at_level(logging.WARNING, "kvgate.gateway.model_router"):
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


async def test_an_adapter_loaded_just_now_is_routed_and_listed(engines, tmp_path) -> None:
    """The table is fresh (its next poll is far off) when the adapter's load answers 200: the
    request for it asks the pools again instead of answering 404."""
    a, _ = engines
    table = ModelTable([PoolSource("alpha", (a.address,))])
    await table.refresh()
    handler = ModelRouterHandler(table)
    for i in range(2):
        adapter = f"just-loaded-{i}"
        async with httpx.AsyncClient(base_url=f"http://{a.address}", timeout=10) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": str(tmp_path)})
        assert r.status_code == 200, r.text
        out = await _send(
            handler, _headers("POST", "/v1/completions"), _body(json.dumps({"model": adapter}).encode())
        )
        assert _set_headers(out[0])[POOL_HEADER] == "alpha", out[0]
    out = await _send(handler, _headers("GET", "/v1/models/just-loaded-1", end=True))
    assert json.loads(out[0].immediate_response.body)["id"] == "just-loaded-1"
    await table.close()


async def test_misses_share_refreshes_at_most_one_per_gap(engines) -> None:
    a, b = engines
    table = ModelTable([PoolSource("alpha", (a.address,)), PoolSource("beta", (b.address,))])
    await table.refresh()
    handler = ModelRouterHandler(table)

    async def unknown(i: int) -> int:
        out = await _send(handler, _headers("POST", "/v1/completions"), _body(b'{"model": "made-up-%d"}' % i))
        return out[0].immediate_response.status.code

    # a burst at once: one refresh (begun after they came) answers all of them
    before = table.refreshes
    assert await asyncio.gather(*(unknown(i) for i in range(200))) == [404] * 200
    assert table.refreshes - before == 1
    # clients that send their next made-up name as soon as the last is refused: one refresh per gap
    before, t0 = table.refreshes, time.monotonic()

    async def client(c: int) -> None:
        for i in range(8):
            assert await unknown(100 * c + i) == 404

    await asyncio.gather(*(client(c) for c in range(4)))
    elapsed = time.monotonic() - t0
    assert table.refreshes - before <= elapsed / MISS_REFRESH_GAP_S + 1, (table.refreshes - before, elapsed)
    assert elapsed >= 7 * MISS_REFRESH_GAP_S  # each round waited for a refresh newer than itself
    # a known model never waits for one
    before = table.refreshes
    out = await _send(handler, _headers("POST", "/v1/completions"), _body(b'{"model": "beta"}'))
    assert _set_headers(out[0])[POOL_HEADER] == "beta" and table.refreshes == before
    await table.close()


def test_cli_refuses_bad_pools() -> None:
    for bad in ("alpha", "alpha=", "alpha=host", "=127.0.0.1:1"):
        out = harness.run_kvgate("router", "serve", "--pool", bad)
        assert out.returncode == 2 and "NAME=HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    out = harness.run_kvgate("router", "serve", "--pool", "a=127.0.0.1:1", "--pool", "a=127.0.0.1:2")
    assert out.returncode == 2 and "unique" in out.stderr


def _with_auth(request: ep.ProcessingRequest, value: str) -> ep.ProcessingRequest:
    request.request_headers.headers.headers.append(
        base_pb2.HeaderValue(key="authorization", raw_value=value.encode())
    )
    return request


async def test_with_tenants_every_request_and_the_model_list_need_a_key(engines) -> None:
    """The pools' EPPs check the tenants' keys on what they pick; the router answers the model
    list itself, so with tenants it checks the same keys, on every request, before the body."""
    from kvgate.epp.tenants import parse_tenants

    a, b = engines
    table = ModelTable([PoolSource("alpha", (a.address,)), PoolSource("beta", (b.address,))])
    await table.refresh()
    key = "k" * 40
    handler = ModelRouterHandler(table, tenants=parse_tenants([{"name": "team", "key": key}]))
    for auth in (None, "Bearer " + "x" * 40, key, "Basic " + key):
        for request in (_headers("GET", "/v1/models", end=True), _headers("POST", "/v1/completions")):
            if auth is not None:
                request = _with_auth(request, auth)
            (out,) = await _send(handler, request)
            reply = out.immediate_response
            assert reply.status.code == 401, auth
            error = json.loads(reply.body)["error"]
            assert error["code"] == "invalid_api_key" and key not in reply.body.decode()
            assert {h.header.key for h in reply.headers.set_headers} >= {"www-authenticate"}
    out = await _send(handler, _with_auth(_headers("GET", "/v1/models", end=True), f"Bearer {key}"))
    assert {m["id"] for m in json.loads(out[0].immediate_response.body)["data"]} >= {"alpha", "beta"}
    out = await _send(
        handler, _with_auth(_headers("POST", "/v1/completions"), f"Bearer {key}"), _body(b'{"model": "beta"}')
    )
    assert _set_headers(out[0])[POOL_HEADER] == "beta"
    await table.close()


def test_cli_refuses_a_bad_tenants_file(tmp_path) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("- {name: a, key: short}\n")
    out = harness.run_kvgate("router", "serve", "--pool", "a=127.0.0.1:1", "--tenants", str(bad))
    assert out.returncode == 2 and "--tenants" in out.stderr and "Traceback" not in out.stderr


def test_each_pools_engine_key_comes_from_its_file_else_the_common_key(tmp_path) -> None:
    """A ModelDeployment with tenants has engines that require a key of their own (its Secret
    <name>-engine-key, projected into the router's pod as a file named after the pool); read at
    every poll, so a key made after the router started is used from the next refresh."""
    table = ModelTable(
        [PoolSource("a", ("127.0.0.1:1",)), PoolSource("b", ("127.0.0.1:2",))],
        api_key="common",
        engine_keys=tmp_path,
    )
    assert table.engine_key("a") == "common"  # no file yet
    (tmp_path / "a").write_text("key-of-a\n")
    assert table.engine_key("a") == "key-of-a" and table.engine_key("b") == "common"
    (tmp_path / "b").write_text("")  # an empty or unreadable file is no key
    assert table.engine_key("b") == "common"
    (tmp_path / "b").write_bytes(b"\x00\x01binary")
    assert table.engine_key("b") == "common"
    (tmp_path / "b").write_text("rotated")
    assert table.engine_key("b") == "rotated"
    assert table.engine_key("../a") == "common" and table.engine_key(".hidden") == "common"
    assert ModelTable([PoolSource("a", ("127.0.0.1:1",))]).engine_key("a") is None

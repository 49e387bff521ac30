"""One gateway, several models: `kvgate up --pool NAME=MODEL[:ENGINES]` as a user runs it. The
model router picks the pool from each body's model, the pool's own EPP picks the engine; the
openai client sees one endpoint that lists and serves every model, and a 404 for the others."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, start_up, stop_up

pytestmark = pytest.mark.timeout(180)
UPSTREAM = "x-kvgate-upstream"
BETA_ADAPTER = "beta-sum"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    logs = tmp_path_factory.mktemp("pools")
    up = start_up(
        logs,
        "--simulate",
        "--pool",
        "alpha=default:2",
        "--pool",
        "beta=default",
        "--epp-replicas",
        "1",
        "--expose-upstream-header",
        # every engine may load adapters at run time (the router must find them)
        "--engine-arg=--enable-lora",
        # an adapter given at start to one pool only (simulated engines: any folder is an adapter)
        "--lora-modules",
        f"beta/{BETA_ADAPTER}={logs}",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def _client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.stack["gateway_url"] + "/v1", api_key="unused", max_retries=0)


def _engines(up: UpProcess, pool: str) -> set[str]:
    return {u.removeprefix("http://") for u in up.stack["pools"][pool]["engine_urls"]}


def test_stack_json_and_progress_name_every_pool(stack: UpProcess) -> None:
    info = stack.stack
    assert set(info["pools"]) == {"alpha", "beta"}
    assert len(info["pools"]["alpha"]["engine_urls"]) == 2 and len(info["pools"]["beta"]["engine_urls"]) == 1
    assert len(info["engine_urls"]) == 3 and info["router_pid"]
    text = "\n".join(stack.lines)
    for part in ("engine-alpha-0 ready", "engine-alpha-1 ready", "engine-beta-0 ready", "epp-alpha ready"):
        assert part in text
    assert "router ready" in text and "models 'alpha', 'beta'" in text
    assert f"beta (1 x default, adapters {BETA_ADAPTER})" in text


def test_models_lists_every_pool(stack: UpProcess) -> None:
    client = _client(stack)
    assert {m.id for m in client.models.list()} == {"alpha", "beta", BETA_ADAPTER}
    assert client.models.retrieve("beta").id == "beta"
    card = client.models.retrieve(BETA_ADAPTER)  # listed under its pool's model
    assert card.model_extra and card.model_extra.get("parent") == "beta"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gamma")


def test_each_model_is_served_by_its_own_pool(stack: UpProcess) -> None:
    client = _client(stack).with_options(max_retries=0)
    for model in ("alpha", "beta", "alpha", "beta", "alpha", "alpha"):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": f"hello {model}"}], max_tokens=3
        )
        assert raw.headers[UPSTREAM] in _engines(stack, model), (model, raw.headers[UPSTREAM])
        assert raw.parse().model == model
    stream = client.completions.create(model="beta", prompt="count with me", max_tokens=4, stream=True)
    assert len([c for c in stream if c.choices]) >= 1


def test_a_pools_startup_adapter_is_served_by_that_pool_only(stack: UpProcess) -> None:
    client = _client(stack)
    for i in range(3):
        raw = client.completions.with_raw_response.create(model=BETA_ADAPTER, prompt=f"sum {i}", max_tokens=2)
        assert raw.headers[UPSTREAM] in _engines(stack, "beta")
        assert raw.parse().model == BETA_ADAPTER
    # kvgate up gave it to beta's engines alone
    for pool, listed in (("alpha", False), ("beta", True)):
        for engine in stack.stack["pools"][pool]["engine_urls"]:
            ids = {m["id"] for m in httpx.get(engine + "/v1/models", timeout=5).json()["data"]}
            assert (BETA_ADAPTER in ids) is listed, (pool, ids)


def test_unknown_model_is_404_from_the_gateway(stack: UpProcess) -> None:
    client = _client(stack)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    body = err.value.body
    assert isinstance(body, dict) and "gamma" in body["message"] and body["type"] == "NotFoundError"
    # no engine saw it: every engine's request counter is unchanged by a burst of unknown models
    before = _requests_seen(stack)
    for i in range(5):
        resp = httpx.post(
            stack.stack["gateway_url"] + "/v1/completions", json={"model": f"x{i}", "prompt": "p"}, timeout=10
        )
        assert resp.status_code == 404 and resp.json()["error"]["code"] == 404
    assert _requests_seen(stack) == before


def test_a_forged_pool_header_does_not_choose_the_pool(stack: UpProcess) -> None:
    url = stack.stack["gateway_url"]
    for _ in range(3):
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": "alpha", "prompt": "hi", "max_tokens": 2},
            headers={"x-kvgate-pool": "beta", "x-gateway-model-name": "beta"},
            timeout=10,
        )
        assert resp.status_code == 200 and resp.headers[UPSTREAM] in _engines(stack, "alpha")
    # bodyless: no pool, whatever the client says
    resp = httpx.get(url + "/v1/anything", headers={"x-kvgate-pool": "beta"}, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_bad_bodies_are_openai_errors(stack: UpProcess) -> None:
    url = stack.stack["gateway_url"] + "/v1/chat/completions"
    for raw in (b"not json", b"[]", b'{"messages": []}', b'{"model": 7}'):
        resp = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert resp.status_code == 400, (raw, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_adapters_loaded_at_run_time_are_listed_and_routed_to_their_pools(stack: UpProcess, tmp_path) -> None:
    # simulated engines: any existing folder is an adapter
    adapters = {"alpha": "alpha-sql", "beta": "beta-chat"}
    for pool, adapter in adapters.items():
        for engine in stack.stack["pools"][pool]["engine_urls"]:
            resp = httpx.post(
                engine + "/v1/load_lora_adapter",
                json={"lora_name": adapter, "lora_path": str(tmp_path)},
                timeout=10,
            )
            assert resp.status_code == 200, resp.text
    client = _client(stack)
    want = {"alpha", "beta", BETA_ADAPTER, *adapters.values()}
    eventually(
        lambda: {m.id for m in client.models.list()} == want, 15, "the router lists both pools' adapters"
    )
    for pool, adapter in adapters.items():
        card = client.models.retrieve(adapter)
        assert card.model_extra and card.model_extra.get("parent") == pool
        for _ in range(3):
            raw = client.completions.with_raw_response.create(model=adapter, prompt="select", max_tokens=2)
            assert raw.headers[UPSTREAM] in _engines(stack, pool)
            assert raw.parse().model == adapter
    # the adapter ran on its pool's engines: vLLM's LoRA gauge names it as running or done there
    info = httpx.get(stack.stack["pools"]["beta"]["engine_urls"][0] + "/metrics", timeout=5).text
    assert "vllm:lora_requests_info" in info


def test_an_adapter_is_routed_the_moment_its_load_returns(stack: UpProcess, tmp_path) -> None:
    """No poll window: the router asks the pools' model lists again before it answers 404, so the
    first request for an adapter right after its load answered 200 goes to its pool."""
    url = stack.stack["gateway_url"]
    (engine,) = stack.stack["pools"]["beta"]["engine_urls"]
    for i in range(3):
        adapter = f"fresh-{i}"
        resp = httpx.post(
            engine + "/v1/load_lora_adapter",
            json={"lora_name": adapter, "lora_path": str(tmp_path)},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        resp = httpx.post(
            url + "/v1/completions", json={"model": adapter, "prompt": "now", "max_tokens": 2}, timeout=10
        )
        assert resp.status_code == 200, (adapter, resp.status_code, resp.text)
        assert resp.headers[UPSTREAM] == engine.removeprefix("http://") and resp.json()["model"] == adapter


def test_a_flood_of_unknown_models_costs_a_few_model_list_refreshes(stack: UpProcess) -> None:
    """Each unknown model asks the pools again, but at most every 0.2 s, shared by every request
    waiting: 200 concurrent requests for made-up models are 200 404s and a handful of GETs."""
    url = stack.stack["gateway_url"] + "/v1/completions"
    (engine,) = stack.stack["pools"]["beta"]["engine_urls"]

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=20, limits=limits) as client:
            answers = await asyncio.gather(
                *(client.post(url, json={"model": f"bogus-{i}", "prompt": "p"}) for i in range(200))
            )
        return [r.status_code for r in answers]

    before, posts = _model_gets(engine), _requests_seen(stack)
    t0 = time.monotonic()
    statuses = asyncio.run(flood())
    elapsed = time.monotonic() - t0
    asked = _model_gets(engine) - before
    assert statuses == [404] * 200
    assert _requests_seen(stack) == posts  # none reached an engine
    # the router's own 1 s poll and the pool EPP's poll ask too: at most one each in the window
    assert asked <= elapsed / 0.2 + elapsed / 1.0 + 3, (asked, elapsed)


def _model_gets(engine_url: str) -> float:
    """GET /v1/models the engine answered (the router's polls and its pool EPP's)."""
    text = httpx.get(engine_url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and 'handler="/v1/models"' in line
    )


def _requests_seen(up: UpProcess) -> float:
    total = 0.0
    for url in up.stack["engine_urls"]:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            # every POST an engine answered, whatever its status (scrapes and model polls are GETs)
            if line.startswith("http_requests_total{") and 'method="POST"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total

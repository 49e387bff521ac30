"""The EPP's scraper learns an adapter loaded or unloaded at run time within a scrape or two,
not at its next 10 s GET /v1/models poll: a real `--simulate --enable-lora` engine, the real
scraper and datastore. The signal is the engine's http_requests_total for the load/unload
handlers (vLLM exports the same), seen on the 50 ms /metrics scrape."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointState
from kvgate.epp.scraper import MAPPINGS, MODELS_MIN_GAP_S, MetricsScraper, parse_metrics
from kvgate.testing import eventually_async
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(90)
ADAPTER = "late-lora"
FAST_S = 1.0  # the bound the test asserts; the 10 s poll cannot meet it


def _model_gets(engine: harness.Engine) -> float:
    """GET /v1/models the engine answered (only the scraper asks it here)."""
    text = harness.http_get(f"http://{engine.address}/metrics")[1]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and 'handler="/v1/models"' in line
    )


async def _post(engine: harness.Engine, path: str, body: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=f"http://{engine.address}", timeout=10) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text


async def _seconds_until(cond, what: str) -> float:
    t0 = time.monotonic()
    await eventually_async(cond, 15, what, interval=0.01)
    return time.monotonic() - t0


@contextlib.asynccontextmanager
async def _scraped_engine(tmp_path) -> AsyncIterator[tuple[harness.Engine, EndpointState]]:
    """A real --enable-lora engine and a scraper polling it, past its first GET /v1/models (the
    next regular one is 10 s away)."""
    engine = harness.start_engine(tmp_path, "--enable-lora")
    try:
        await asyncio.to_thread(engine.wait_ready)
        ds = Datastore()
        scraper = MetricsScraper(ds, MAPPINGS["vllm"])
        ds.set_endpoints([Endpoint(engine.address)])
        state = ds.all()[0]
        await eventually_async(lambda: bool(state.served_models), 10, "the first GET /v1/models")
        yield engine, state
        ds.set_endpoints([])
        await scraper.close()
    finally:
        harness.stop_all(engine.proc)


async def test_runtime_load_and_unload_reach_the_datastore_within_a_second(tmp_path) -> None:
    async with _scraped_engine(tmp_path) as (engine, state):
        # right after that first poll: the next one is 10 s away
        await _post(engine, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(tmp_path)})
        took = await _seconds_until(lambda: ADAPTER in state.served_models, "the adapter listed")
        assert took < FAST_S, took
        assert ADAPTER in state.served_adapters
        await _post(engine, "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
        took = await _seconds_until(lambda: ADAPTER not in state.served_models, "the adapter dropped")
        assert took < FAST_S, took


async def test_adapter_churn_is_followed_without_a_refetch_storm(tmp_path) -> None:
    """Loads and unloads back to back: the model list is asked again at most every
    MODELS_MIN_GAP_S, and the last change is never missed."""
    async with _scraped_engine(tmp_path) as (engine, state):
        before = await asyncio.to_thread(_model_gets, engine)
        t0 = time.monotonic()
        for i in range(12):  # a change every scrape or so
            await _post(engine, "/v1/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": str(tmp_path)})
            await asyncio.sleep(0.05)
        await _post(engine, "/v1/unload_lora_adapter", {"lora_name": "a0"})
        final = {f"a{i}" for i in range(1, 12)}
        await eventually_async(lambda: final <= state.served_adapters == final, 5, "the last state")
        elapsed = time.monotonic() - t0
        asked = await asyncio.to_thread(_model_gets, engine) - before
        assert 1 <= asked <= elapsed / MODELS_MIN_GAP_S + 2, (asked, elapsed)


def test_adapter_change_count_reads_the_load_and_unload_handlers_successes_only() -> None:
    """vLLM's instrumentator and kvgate's engine: http_requests_total{handler, method, status},
    status grouped as 2xx; a refused load changes nothing."""
    text = (
        'http_requests_total{handler="/v1/load_lora_adapter",method="POST",status="2xx"} 3.0\n'
        'http_requests_total{handler="/v1/unload_lora_adapter",method="POST",status="2xx"} 1.0\n'
        'http_requests_total{handler="/v1/load_lora_adapter",method="POST",status="4xx"} 7.0\n'
        'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 40.0\n'
    )
    assert parse_metrics(text, MAPPINGS["vllm"], now=1.0).adapter_changes == 4.0
    assert parse_metrics("vllm:num_requests_running 1\n", MAPPINGS["vllm"], now=1.0).adapter_changes is None


async def test_an_adapter_running_but_unlisted_asks_the_model_list_once() -> None:
    """vLLM can load an adapter without the load endpoint (a LoRA resolver, on the first request
    naming it): lora_requests_info then shows it running while the EPP's model list lacks it. A
    stand-in vLLM (none runs here) answers /metrics and /v1/models."""
    running = ""
    listed = ["base"]
    model_gets = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal model_gets
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"/v1/models" in head.split(b"\r\n", 1)[0]:
                    model_gets += 1
                    cards = ",".join(
                        f'{{"id":"{n}","parent":{"null" if n == "base" else "1"}}}' for n in listed
                    )
                    body = f'{{"data":[{cards}]}}'.encode()
                else:
                    body = (
                        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
                        f'waiting_lora_adapters=""}} 1.0\n'
                    ).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ds = Datastore()
    scraper = MetricsScraper(ds, MAPPINGS["vllm"], health_path=None)
    ds.set_endpoints([Endpoint(f"127.0.0.1:{port}")])
    state = ds.all()[0]
    await eventually_async(lambda: state.served_models == {"base"}, 10, "the first GET /v1/models")
    assert model_gets == 1
    listed.append("resolved")
    running = "resolved"
    took = await _seconds_until(lambda: "resolved" in state.served_adapters, "the resolved adapter listed")
    assert took < FAST_S, took
    await asyncio.sleep(3 * MODELS_MIN_GAP_S)  # listed now: no more asking
    assert model_gets == 2
    # running there but still not listed after asking (an unloaded adapter's last requests):
    # asked once when it shows up, not every scrape while it stays
    running = "resolved,ghost"
    await eventually_async(lambda: model_gets == 3, 5, "the list asked again")
    await asyncio.sleep(3 * MODELS_MIN_GAP_S)
    assert model_gets == 3 and "ghost" not in state.served_models
    ds.set_endpoints([])
    await scraper.close()
    server.close()

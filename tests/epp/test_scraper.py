"""Metrics scraping: vLLM / SGLang / TRT-LLM names, LoRA info, staleness, unreachable endpoints."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.http_get import EndpointRefused, KeepAliveGetter, ScrapeError
from kvgate.epp.scraper import MAPPINGS, MetricMapping, MetricSpec, MetricsScraper, parse_metrics
from kvgate.testing import eventually_async

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_waiting_by_reason{reason="x"} 99
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",waiting_lora_adapters="d"} 1.8e9
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0
"""


def test_vllm_names_sum_counts_max_utilisation_latest_lora() -> None:
    m = parse_metrics(VLLM, MAPPINGS["vllm"], now=5.0)
    assert (m.waiting, m.running, m.kv_usage, m.updated_at) == (5, 7, 0.5, 5.0)
    assert (m.max_lora, m.running_loras, m.waiting_loras) == (2, frozenset({"c"}), frozenset({"d"}))


def test_kvgates_batch_slots_add_up_and_a_forged_value_is_bounded() -> None:
    assert parse_metrics(VLLM, MAPPINGS["vllm"], now=5.0).max_num_seqs == 0  # vLLM says none
    two = 'kvgate:max_num_seqs{engine="0",model_name="m"} 128\nkvgate:max_num_seqs{engine="1",model_name="m"} 64\n'
    assert parse_metrics(two, MAPPINGS["vllm"], now=1.0).max_num_seqs == 192
    for forged in ("+Inf", "NaN", "-5", "1e300"):
        m = parse_metrics(f'kvgate:max_num_seqs{{engine="0"}} {forged}\n', MAPPINGS["vllm"], now=1.0)
        assert 0 <= m.max_num_seqs <= 1 << 20, forged


def test_kvgates_sheddable_parts_add_up_and_forged_values_are_bounded() -> None:
    assert not parse_metrics(VLLM, MAPPINGS["vllm"], now=5.0).has_sheddable  # vLLM says none
    text = (
        'kvgate:num_requests_running_sheddable{engine="0"} 3\n'
        'kvgate:num_requests_running_sheddable{engine="1"} 2\n'
        "kvgate:num_requests_waiting_sheddable 4\n"
        "kvgate:prefill_tokens_pending_sheddable 512\n"
    )
    m = parse_metrics(text, MAPPINGS["vllm"], now=1.0)
    assert (m.sheddable_running, m.sheddable_waiting, m.sheddable_prefill_tokens) == (5, 4, 512)
    for forged, expect in (("+Inf", 10**12), ("NaN", 0), ("-7", 0)):
        m = parse_metrics(f"kvgate:num_requests_waiting_sheddable {forged}\n", MAPPINGS["vllm"], now=1.0)
        assert m.sheddable_waiting == expect, forged


def test_deprecated_gpu_cache_alias() -> None:
    m = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n', MAPPINGS["vllm"], now=1.0)
    assert m.kv_usage == 0.75


def test_sglang_and_trtllm_mappings() -> None:
    sg = "sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\nsglang:token_usage 0.3\n"
    m = parse_metrics(sg, MAPPINGS["sglang"], now=1.0)
    assert (m.waiting, m.running, m.kv_usage) == (4, 2, 0.3)
    trt = (
        'nv_trt_llm_request_metrics{request_type="waiting"} 6\n'
        'nv_trt_llm_request_metrics{request_type="scheduled"} 3\n'
        'nv_trt_llm_request_metrics{request_type="context"} 100\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"} 0.4\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"} 400\n'
    )
    m = parse_metrics(trt, MAPPINGS["triton-tensorrt-llm"], now=1.0)
    assert (m.waiting, m.running, m.kv_usage) == (6, 3, 0.4)


def test_metric_spec_parsing() -> None:
    assert MetricSpec.parse('x_total{a="1", b=2}') == MetricSpec("x_total", (("a", "1"), ("b", "2")))
    with pytest.raises(ValueError, match="not a metric spec"):
        MetricSpec.parse("bad name!")


async def _serve(handler) -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_keep_alive_getter_content_length_chunked_and_close() -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 503 Busy\r\nconnection: close\r\ncontent-length: 2\r\n\r\nno",
    ]
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        try:
            while replies:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(replies.pop(0))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server, port = await _serve(handler)
    getter = KeepAliveGetter("127.0.0.1", port)
    assert await getter.get() == (200, b"hello")
    assert await getter.get() == (200, b"abcde")
    assert await getter.get() == (503, b"no")
    assert connections == 1  # one kept-alive connection for all three
    getter.close()
    server.close()
    with pytest.raises(EndpointRefused):
        await KeepAliveGetter("127.0.0.1", port).get()


async def test_getter_times_out_on_a_silent_server() -> None:
    async def handler(reader, writer):
        await asyncio.sleep(5)

    server, port = await _serve(handler)
    with pytest.raises(ScrapeError):
        await KeepAliveGetter("127.0.0.1", port, timeout=0.2).get()
    server.close()


def _keep_alive_metrics(body: bytes, writers: list[asyncio.StreamWriter]):
    """A /metrics server handler answering `body` on a kept-alive connection (each connection's
    writer lands in `writers`, so a test can cut them)."""

    async def handler(reader, writer):
        writers.append(writer)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return handler


async def test_scraper_updates_datastore_and_drops_dead_endpoints() -> None:
    writers: list[asyncio.StreamWriter] = []
    handler = _keep_alive_metrics(VLLM.encode(), writers)

    server, port = await _serve(handler)
    ds = Datastore()
    scraper = MetricsScraper(ds, MAPPINGS["vllm"], interval=0.02)
    t0 = time.monotonic()
    ds.set_endpoints([Endpoint(f"127.0.0.1:{port}")])
    state = ds.all()[0]
    await eventually_async(lambda: ds.reachable(state) and state.metrics.waiting == 5, 5, "first scrape")
    first = state.metrics.updated_at
    assert t0 <= first <= time.monotonic()  # stamped (monotonic clock) when it was scraped
    # it keeps scraping: the metrics stay fresh
    await eventually_async(lambda: state.metrics.updated_at > first, 5, "a later scrape")
    server.close()  # the engine dies: listener and kept-alive connections go
    for w in writers:
        w.close()
    await eventually_async(lambda: not ds.reachable(state), 5, "the dead endpoint dropped")
    ds.set_endpoints([])
    await scraper.close()


def test_mapping_override_is_used() -> None:
    mapping = MetricMapping(MetricSpec("q"), MetricSpec("r"), MetricSpec("kv"))
    m = parse_metrics("q 1\nr 2\nkv 0.9\n", mapping, now=1.0)
    assert (m.waiting, m.running, m.kv_usage) == (1, 2, 0.9)


async def test_an_engine_still_starting_is_not_logged_as_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`kvgate up` starts the EPP beside engines that load their model for seconds: those first
    refused scrapes are not news. Once answered, the endpoint is 'reachable'; losing it later
    is 'unreachable'."""
    writers: list[asyncio.StreamWriter] = []
    handler = _keep_alive_metrics(VLLM.encode(), writers)

    caplog.set_level(logging.INFO, logger="kvgate.epp.scraper")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens there yet: the engine is "starting"
    ds = Datastore()
    scraper = MetricsScraper(ds, MAPPINGS["vllm"], interval=0.02)
    ds.set_endpoints([Endpoint(f"127.0.0.1:{port}")])
    state = ds.all()[0]
    await eventually_async(lambda: state.metrics.consecutive_failures >= 3, 5, "refused scrapes")
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    await eventually_async(lambda: ds.reachable(state), 5, "the engine up")
    assert [r.getMessage() for r in caplog.records] == [f"endpoint 127.0.0.1:{port} reachable"]
    server.close()
    for w in writers:
        w.close()
    await eventually_async(lambda: not ds.reachable(state), 5, "the engine gone")
    await eventually_async(lambda: "unreachable" in caplog.text, 5, "its loss logged")
    ds.set_endpoints([])
    await scraper.close()

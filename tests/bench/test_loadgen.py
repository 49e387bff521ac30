"""The load generator's SSE client and pacing, against an in-process HTTP transport.

The engines themselves are exercised in e2e/ through the real stack; here the transport only
stands in for "some OpenAI-compatible server" so stream edge cases can be produced exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

from kvgate.bench.loadgen import LoadSpec, Target, arrival_times, run_load
from kvgate.bench.workloads import MultiTurnSpec, SharedPrefixSpec, WorkloadSpec, generate

TARGET = Target(base_url="http://test", model="m")


def sse(*chunks: object, done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    if done:
        body += "data: [DONE]\n\n"
    return body.encode()


def token_chunk(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def usage_chunk(prompt: int, completion: int) -> dict[str, object]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def requests(n: int, kind: str = "shared-prefix"):
    spec = WorkloadSpec(
        kind=kind,  # type: ignore[arg-type]
        shared_prefix=SharedPrefixSpec(groups=2, prefix_tokens=8, suffix_tokens=4, output_tokens=3),
        multi_turn=MultiTurnSpec(conversations=1, turns=3, first_turn_tokens=4, user_turn_tokens=3),
    )
    return itertools.islice(generate(spec), n)


async def test_streams_are_timed_and_usage_is_read() -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(
            200, content=sse(token_chunk("a"), token_chunk("b"), token_chunk("c"), usage_chunk(20, 3))
        )

    results, duration = await run_load(
        TARGET, requests(4), LoadSpec(concurrency=2, num_requests=4), transport=httpx.MockTransport(handler)
    )
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert all(r.ok and r.output_tokens == 3 and r.prompt_tokens == 20 for r in results)
    assert all(len(r.token_times) == 3 and len(r.itls) == 2 and r.ttft is not None for r in results)
    body = seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user"]  # type: ignore[union-attr]
    assert duration > 0


async def test_http_errors_broken_and_unfinished_streams_are_errors() -> None:
    calls = itertools.count()

    def handler(request: httpx.Request) -> httpx.Response:
        n = next(calls)
        if n == 0:
            return httpx.Response(
                429, json={"error": {"message": "queue full", "type": "x", "param": None, "code": 429}}
            )
        if n == 1:
            return httpx.Response(200, content=sse(token_chunk("a"), done=False))
        if n == 2:
            return httpx.Response(200, content=sse(token_chunk("a"), {"error": {"message": "engine died"}}))
        raise httpx.ConnectError("refused")

    results, _ = await run_load(
        TARGET, requests(4), LoadSpec(concurrency=1, num_requests=4), transport=httpx.MockTransport(handler)
    )
    errors = [r.error for r in results]
    assert errors[0] == "HTTP 429: queue full" and results[0].status == 429
    assert errors[1] == "stream ended without [DONE]" and results[1].started_streaming
    assert errors[2] == "stream error: engine died"
    assert errors[3] is not None and "ConnectError" in errors[3] and results[3].status is None
    assert not any(r.ok for r in results)


async def test_multi_turn_waits_for_the_previous_turn() -> None:
    order: list[tuple[str, int]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        n = len(json.loads(request.content)["messages"])
        order.append(("start", n))
        await asyncio.sleep(0.05)
        order.append(("end", n))
        return httpx.Response(200, content=sse(token_chunk("x"), usage_chunk(5, 1)))

    await run_load(
        TARGET,
        requests(3, "multi-turn"),
        LoadSpec(request_rate=1000.0, num_requests=3),
        transport=httpx.MockTransport(handler),
    )
    # system+user, then +assistant+user, then again: each starts only after the previous ended.
    assert order == [("start", 2), ("end", 2), ("start", 4), ("end", 4), ("start", 6), ("end", 6)]


async def test_concurrency_caps_requests_in_flight() -> None:
    in_flight = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, content=sse(token_chunk("x")))

    results, _ = await run_load(
        TARGET, requests(20), LoadSpec(concurrency=3, num_requests=20), transport=httpx.MockTransport(handler)
    )
    assert len(results) == 20 and all(r.ok for r in results)
    assert peak == 3


async def test_duration_stops_sending() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(token_chunk("x")))

    t0 = time.perf_counter()
    results, _ = await run_load(
        TARGET,
        requests(10_000),
        LoadSpec(request_rate=100.0, duration_s=0.3),
        transport=httpx.MockTransport(handler),
    )
    assert time.perf_counter() - t0 < 2.0
    assert 5 <= len(results) <= 80


def test_poisson_arrivals_have_the_requested_mean_rate_and_are_seeded() -> None:
    times = list(itertools.islice(arrival_times(20.0, seed=1), 4001))
    assert times[-1] / 4000 == pytest.approx(1 / 20.0, rel=0.08)
    assert times[:10] == list(itertools.islice(arrival_times(20.0, seed=1), 10))


@pytest.mark.parametrize(
    ("load", "message"),
    [
        (LoadSpec(num_requests=1), "request-rate"),
        (LoadSpec(request_rate=1.0), "num-requests"),
        (LoadSpec(request_rate=-1.0, num_requests=1), "> 0"),
        (LoadSpec(concurrency=0, num_requests=1), "at least 1"),
    ],
)
async def test_bad_load_specs_are_clear_errors(load: LoadSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await run_load(TARGET, requests(1), load)

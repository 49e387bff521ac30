"""The load generator: streaming chat clients against an OpenAI-compatible endpoint.

Open loop (Poisson arrivals at `request_rate`, optionally capped at `concurrency` in flight, as
vLLM's `bench serve --request-rate --max-concurrency`) or closed loop (`concurrency` clients,
each sending its next request when the last one ends). A run ends after `num_requests` or
once `duration_s` has passed (in-flight requests are then awaited, like vLLM's benchmark).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from kvgate.bench.stats import RequestResult
from kvgate.bench.workloads import BenchRequest


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8080 (no /v1)
    model: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    ignore_eos: bool = True  # fixed output lengths make strategies comparable


@dataclass(frozen=True)
class LoadSpec:
    request_rate: float | None = None  # requests/s, Poisson; None = no pacing (needs concurrency)
    concurrency: int | None = None  # max in flight
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    # Sent first, at the same pacing, and left out of every statistic: caches and queues reach
    # their steady state before measuring (the same warm-up requests for every strategy).
    warmup_requests: int = 0

    def validate(self) -> None:
        if self.request_rate is None and self.concurrency is None:
            raise ValueError("give --request-rate, --concurrency, or both")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests, --duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be > 0")
        if self.warmup_requests < 0:
            raise ValueError("--warmup-requests must be >= 0")


# Set by kvgate's Envoy config on every routed response: which engine served it.
UPSTREAM_HEADER = "x-kvgate-upstream"

ProgressHook = Callable[[RequestResult], None]


def chat_payload(req: BenchRequest, target: Target) -> dict[str, object]:
    payload: dict[str, object] = {
        "model": req.model or target.model,
        "messages": req.payload_messages(),
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if target.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _error_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip()[:200] or "empty body"


async def send_one(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, run_start: float
) -> RequestResult:
    """Send one streaming chat request and time every content chunk."""
    sent = time.perf_counter()
    result = RequestResult(index=req.index, group=req.group, sent_at=sent - run_start)
    headers = dict(target.headers)
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    url = target.base_url.rstrip("/") + "/v1/chat/completions"
    chunks = 0
    done = False
    try:
        async with client.stream("POST", url, json=chat_payload(req, target), headers=headers) as resp:
            result.status = resp.status_code
            result.upstream = resp.headers.get(UPSTREAM_HEADER)
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or choice.get("text"):
                        now = time.perf_counter() - sent
                        if result.ttft is None:
                            result.ttft = now
                            result.started_streaming = True
                        result.token_times.append(now)
                        chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    except json.JSONDecodeError:
        result.error = "malformed stream chunk"
        return result
    if not done:
        result.error = "stream ended without [DONE]"
        return result
    if result.output_tokens == 0:
        result.output_tokens = chunks
    result.e2e = time.perf_counter() - sent
    return result


def _past(start: float, duration_s: float | None) -> bool:
    return duration_s is not None and time.perf_counter() - start >= duration_s


def arrival_times(rate: float, seed: int) -> Iterator[float]:
    """Poisson process: exponential gaps with mean 1/rate, seed-deterministic."""
    rng = random.Random(f"{seed}:arrivals")
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


async def run_load(
    target: Target,
    requests: Iterator[BenchRequest],
    load: LoadSpec,
    on_result: ProgressHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[RequestResult], float]:
    """Drive the load; returns every request's result and the run's wall time in seconds."""
    load.validate()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(target.request_timeout_s, connect=10.0)
    results: list[RequestResult] = []
    finished: dict[int, asyncio.Event] = {}
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    arrivals = arrival_times(load.request_rate, load.seed) if load.request_rate else None
    tasks: list[asyncio.Task[None]] = []

    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, holds_slot: bool) -> None:
            try:
                if req.depends_on is not None and req.depends_on in finished:
                    await finished[req.depends_on].wait()
                if slots is not None and not holds_slot:
                    async with slots:
                        result = await send_one(client, target, req, start)
                else:
                    result = await send_one(client, target, req, start)
                results.append(result)
                if on_result is not None:
                    on_result(result)
            finally:
                finished[req.index].set()
                if holds_slot and slots is not None:
                    slots.release()

        for n, req in enumerate(requests):
            if load.num_requests is not None and n >= load.num_requests:
                break
            if _past(start, load.duration_s):
                break
            holds_slot = False
            if arrivals is not None:
                delay = start + next(arrivals) - time.perf_counter()
                if load.duration_s is not None:
                    delay = min(delay, start + load.duration_s - time.perf_counter())
                if delay > 0:
                    await asyncio.sleep(delay)
                if _past(start, load.duration_s):
                    break
            elif slots is not None:
                # Closed loop: the next request leaves only when a client is free. (Its
                # dependency, if any, was sent earlier, so holding the slot cannot deadlock.)
                if load.duration_s is None:
                    await slots.acquire()
                else:
                    remaining = start + load.duration_s - time.perf_counter()
                    try:
                        await asyncio.wait_for(slots.acquire(), timeout=max(remaining, 0.0))
                    except TimeoutError:
                        break
                holds_slot = True
            finished[req.index] = asyncio.Event()
            tasks.append(asyncio.create_task(one(req, holds_slot)))
        if tasks:
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    results.sort(key=lambda r: r.index)
    return results, duration

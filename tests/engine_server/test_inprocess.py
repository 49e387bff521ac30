"""The server's parts in one process: engine-loop crash handling, admission races, failure
injection switched off, and the Prometheus renderer's edge cases."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.core.runner_api import SampledToken, ScheduledBatch
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.app import ServerState, build_app
from kvgate.engine.server.async_engine import AsyncEngine, EngineDeadError
from kvgate.engine.server.metrics import CacheConfigInfo, EngineMetrics, StatsSnapshot
from kvgate.engine.server.serving import ModelInfo, OpenAIServing
from kvgate.engine.sim_runner import SimulatedRunner
from kvgate.testing import eventually_async


class DeviceLost(SimulatedRunner):
    """Stands in for a GPU that fails mid-run: the one thing this machine cannot produce."""

    fail_after = 3

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        if self.steps >= self.fail_after:
            raise RuntimeError("CUDA error: device lost")
        return super().execute(batch)


class Stepper(SimulatedRunner):
    """Ends each engine step only when the test grants it, so the queue holds still while the
    test looks at it."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.grants = threading.Semaphore(0)
        self.free = False

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        if not self.free and not self.grants.acquire(timeout=30):
            raise RuntimeError("the test never granted this step")
        return super().execute(batch)

    def run_free(self) -> None:
        self.free = True
        self.grants.release()


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer("default")


def _engine(tokenizer, runner_cls=SimulatedRunner, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig(simulate=True, simulation=SimulationConfig(time_scale=0.0), **kw)
    return LLMEngine(config, runner=runner_cls(config, tokenizer), tokenizer=tokenizer)


async def _server(  # type: ignore[no-untyped-def]
    engine: LLMEngine,
    max_queued_requests: int | None = None,
    adapters: dict[str, str] | None = None,
    **state_kw,
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncEngine]]:
    metrics = EngineMetrics("m", CacheConfigInfo(16, 64, True))
    async_engine = AsyncEngine(engine, metrics, max_queued_requests=max_queued_requests)
    async_engine.start(asyncio.get_running_loop())
    info = ModelInfo(["m"], "m", engine.max_model_len, engine.vocab_size, 0, dict(adapters or {}))
    state = ServerState(
        OpenAIServing(async_engine, engine.tokenizer, info), async_engine, metrics, "test", **state_kw
    )
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, async_engine
    finally:
        await asyncio.to_thread(async_engine.stop)


async def test_engine_crash_fails_requests_and_health(tokenizer) -> None:  # type: ignore[no-untyped-def]
    async for client, async_engine in _server(_engine(tokenizer, DeviceLost)):
        r = await client.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 50, "ignore_eos": True}
        )
        assert r.status_code == 500
        assert "engine loop crashed" in r.json()["error"]["message"]
        assert "CUDA" not in r.text  # no internals to the client
        assert not async_engine.alive
        health = await client.get("/health")
        assert health.status_code == 503
        again = await client.post("/v1/completions", json={"prompt": "hello"})
        assert again.status_code == 503


async def test_client_gone_before_admission_leaves_nothing_behind(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tokenizer)
    async for _, async_engine in _server(engine):
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        task = asyncio.ensure_future(async_engine.submit("gone", [([1000, 2000, 3000], params)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await async_engine.wait_idle(2.0)
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests()
        assert engine.get_stats().kv_cache_usage == 0


async def test_engine_rejection_becomes_400_and_n_is_all_or_nothing(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tokenizer)
    async for _, async_engine in _server(engine):
        bad = SamplingParams(n=2)  # the engine wants n == 1 per request: it must refuse
        good = SamplingParams(max_tokens=1000, ignore_eos=True)
        from kvgate.engine.server.errors import APIError

        with pytest.raises(APIError) as info:
            await async_engine.submit("mixed", [([1000, 2000], good), ([1000, 2000], bad)])
        assert info.value.status == 400
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests(), "the admitted sibling must be aborted"


async def test_full_queue_answers_429(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """One running (max_num_seqs=1) and the queue (max 2) filled while the engine is held inside a
    step: nothing moves until the test grants a step, so the state asserted is the state served."""
    engine = _engine(tokenizer, Stepper, max_num_seqs=1)
    async for client, async_engine in _server(engine, max_queued_requests=2):
        await _fill_queue_and_check(client, async_engine, tokenizer.encode("hello there"))


async def _fill_queue_and_check(
    client: httpx.AsyncClient, async_engine: AsyncEngine, prompt: list[int]
) -> None:
    engine = async_engine.engine
    runner = engine.runner
    assert isinstance(runner, Stepper)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    handles = [await async_engine.submit("running", [(prompt, params)])]  # engine now held in step 1

    async def admit(rid: str) -> None:
        """Queue one more request: the held loop takes it in when the current step ends."""
        task = asyncio.ensure_future(async_engine.submit(rid, [(prompt, params)]))
        await eventually_async(
            lambda: async_engine.num_in_flight == len(handles) + 1, 10, f"{rid} submitted", interval=0.01
        )
        runner.grants.release()
        handles.append(await task)

    async def queue_shown() -> bool:
        text = (await client.get("/metrics")).text
        gauges = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
        return gauges["vllm:num_requests_running"] == 1 and gauges["vllm:num_requests_waiting"] == 2

    await admit("waiting-1")
    # One slot left: a request with n=2 needs two, so it is refused whole.
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    await admit("waiting-2")
    runner.grants.release()  # one more step, so the metrics show the queue
    await eventually_async(queue_shown, 10, "/metrics showing 1 running and 2 waiting", interval=0.01)

    r = await client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 1})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=client)
    with pytest.raises(openai.RateLimitError):
        await oai.completions.create(model="m", prompt="x", max_tokens=1)
    assert not any(h.done for h in handles), "nothing ran while the test looked"
    for h in handles:
        h.close()
    runner.run_free()
    await eventually_async(lambda: not engine.has_unfinished_requests(), 10, "the aborts", interval=0.01)


async def test_failure_header_is_ignored_unless_enabled(tokenizer) -> None:  # type: ignore[no-untyped-def]
    async for client, _ in _server(_engine(tokenizer), failure_injection=False):
        r = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"x-kvgate-inject-failure": "500"},
        )
        assert r.status_code == 200
    async for client, _ in _server(_engine(tokenizer), failure_injection=True):
        r = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"x-kvgate-inject-failure": "500"},
        )
        assert r.status_code == 500


def test_renderer_escapes_labels_and_buckets_are_inclusive() -> None:
    m = EngineMetrics('we"ird\\model\nname', CacheConfigInfo(16, 64, False))
    with m.lock:
        m.ttft.observe(0.01)  # exactly on a bound: counted in le="0.01"
        m.ttft.observe(5000.0)  # above every bound: only +Inf
        m.update(StatsSnapshot(num_running=2, kv_cache_usage=0.25, generation_tokens_total=7))
        m.request_finished("stop")
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    ttft = families["vllm:time_to_first_token_seconds"]
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert buckets["0.005"] == 0 and buckets["0.01"] == 1 and buckets["2560.0"] == 1 and buckets["+Inf"] == 2
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count == 2
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels["model_name"] == 'we"ird\\model\nname' and running.value == 2
    gen = families["vllm:generation_tokens"].samples[0]
    assert gen.value == 7
    assert families["vllm:cache_config_info"].samples[0].labels["enable_prefix_caching"] == "False"


def test_renderer_cache_tracks_changes() -> None:
    m = EngineMetrics("m", CacheConfigInfo(16, 64, True))
    first = m.render()
    assert m.render() is first  # nothing changed: the cached bytes
    with m.lock:
        m.update(StatsSnapshot(num_waiting=3))
    assert b'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0' in m.render()
    m.set_lora_state(max_lora=2, running=["b", "a"], waiting=[])
    text = m.render().decode()
    assert 'running_lora_adapters="a,b"' in text and text.count("vllm:lora_requests_info{") == 1


def test_the_batch_slots_are_exported_for_routers() -> None:
    text = EngineMetrics("m", CacheConfigInfo(16, 64, True), max_num_seqs=32).render().decode()
    assert 'kvgate:max_num_seqs{model_name="m",engine="0"} 32.0' in text


def test_the_sheddable_part_of_the_load_is_exported_for_routers() -> None:
    import types

    stats = types.SimpleNamespace(
        num_running=5,
        num_waiting=4,
        sheddable_running=3,
        sheddable_waiting=2,
        sheddable_prefill_tokens_pending=96,
    )
    m = EngineMetrics("m", CacheConfigInfo(16, 64, True), max_num_seqs=8)
    m.update(StatsSnapshot.from_engine_stats(stats))
    served = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert served["kvgate:num_requests_running_sheddable"] == 3
    assert served["kvgate:num_requests_waiting_sheddable"] == 2
    assert served["kvgate:prefill_tokens_pending_sheddable"] == 96
    assert served["vllm:num_requests_running"] == 5  # vLLM's totals are unchanged


def test_engine_dead_error_carries_status() -> None:
    assert EngineDeadError("x", 503).status == 503


async def test_a_request_shows_as_waiting_while_the_engine_is_inside_a_step(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A router scraping /metrics must see a request the server accepted at once, not after the
    engine's current step and the next one (each can take most of a second on a long prefill).
    Before: waiting stayed 0 until the held step ended."""
    engine = _engine(tokenizer, Stepper)
    prompt = tokenizer.encode("hello there, a prompt of some length")
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    async for client, async_engine in _server(engine):
        runner = engine.runner
        assert isinstance(runner, Stepper)
        first = await async_engine.submit("first", [(prompt, params)])  # held inside step 1
        runner.grants.release()  # step 1 ends; the engine is held inside step 2, first running
        await eventually_async(
            lambda ae=async_engine: _gauges_now(ae) == (1, 0),
            10,
            "first running, none waiting",
            interval=0.01,
        )
        task = asyncio.ensure_future(async_engine.submit("second", [(prompt, params)]))
        await eventually_async(
            lambda ae=async_engine: _gauges_now(ae) == (1, 1),
            10,
            "the second counted mid-step",
            interval=0.01,
        )
        text = (await client.get("/metrics")).text
        served = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
        assert served["vllm:num_requests_waiting"] == 1
        assert served["kvgate:prefill_tokens_pending"] >= len(prompt)
        assert not task.done()  # the engine thread has not taken it in
        runner.run_free()
        second = await task
        for h in (first, second):
            h.close()
        await eventually_async(lambda: not engine.has_unfinished_requests(), 10, "the aborts", interval=0.01)


async def test_an_adapter_unloaded_after_the_name_check_is_an_unknown_model(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The race an unload opens: a request naming the adapter passed the server's check, then
    the unload reached the engine before the request did. The client gets what an unknown model
    gets (vLLM's 404 model_not_found), not a 400 about an internal adapter id. The engine is held
    inside a step so both wait for it together; it takes calls before new requests."""
    engine = _engine(tokenizer, Stepper, enable_lora=True)
    engine.add_lora("a", engine.load_lora("a", "/adapters/a"))
    prompt = tokenizer.encode("hello there")
    async for client, async_engine in _server(engine, adapters={"a": "/adapters/a"}):
        runner = engine.runner
        assert isinstance(runner, Stepper)
        first = await async_engine.submit("first", [(prompt, SamplingParams(max_tokens=100))])
        body = {"model": "a", "prompt": "hi", "max_tokens": 2}
        post = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await eventually_async(
            lambda ae=async_engine: ae.num_in_flight == 2, 10, "a's request in", interval=0.01
        )
        unload = asyncio.ensure_future(async_engine.call(lambda e: e.remove_lora("a")))
        await asyncio.sleep(0.05)
        assert not post.done() and not unload.done()  # both wait for the held step
        runner.run_free()
        assert await unload is True
        r = await post
        assert r.status_code == 404, r.text
        unknown = await client.post("/v1/completions", json={**body, "model": "nope"})
        assert unknown.status_code == 404
        assert r.json() == json.loads(unknown.text.replace("nope", "a"))
        first.close()
        await eventually_async(lambda: not engine.has_unfinished_requests(), 10, "idle", interval=0.01)


def _gauges_now(async_engine: AsyncEngine) -> tuple[float, float]:
    m = async_engine.metrics
    with m.lock:
        return m.running.value, m.waiting.value


async def test_the_queue_order_comes_from_the_epps_headers_or_the_body(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """kvgate.api.contracts.queue_order: the EPP's priority (GIE's, higher first) and tenant win;
    a direct client may set vLLM's body priority (lower first); a malformed header counts as none."""
    engine = _engine(tokenizer)
    seen: list[tuple[int, str, bool]] = []
    add = engine.add_request

    def recording(*args, priority: int = 0, tenant: str = "", over_share: bool = False, **kw):  # type: ignore[no-untyped-def]
        seen.append((priority, tenant, over_share))
        return add(*args, priority=priority, tenant=tenant, over_share=over_share, **kw)

    engine.add_request = recording  # type: ignore[method-assign]
    body = {"prompt": "hello", "max_tokens": 2}
    async for client, _ in _server(engine):
        stamped = {
            "x-kvgate-priority": "2",
            "x-gateway-inference-fairness-id": "team-a",
            "x-kvgate-over-share": "1",
        }
        r = await client.post("/v1/completions", json={**body, "priority": 7}, headers=stamped)
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={**body, "priority": 5})
        assert r.status_code == 200, r.text
        forged = {
            "x-kvgate-priority": "1e9",
            "x-gateway-inference-fairness-id": "../etc",
            "x-kvgate-over-share": "yes",
        }
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3},
            headers=forged,
        )
        assert r.status_code == 200, r.text
    assert seen == [(-2, "team-a", True), (5, "", False), (-3, "", False)]


async def test_a_body_priority_under_fcfs_is_refused_as_vllm_does(tokenizer) -> None:  # type: ignore[no-untyped-def]
    async for client, _ in _server(_engine(tokenizer, scheduling_policy="fcfs")):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "priority" and "--scheduling-policy" in err["message"]
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": 0})
        assert ok.status_code == 200

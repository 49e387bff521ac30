"""Speculative decoding on the request's trace span: an in-process server over a speculating
simulated engine exports `kvgate.engine.request` spans to a loopback OTLP collector, each with
the request's own drafts and accepted drafts, streamed or not."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from kvgate.api.tracing import Tracer
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.app import ServerState, build_app
from kvgate.engine.server.async_engine import AsyncEngine
from kvgate.engine.server.metrics import CacheConfigInfo, EngineMetrics
from kvgate.engine.server.serving import ModelInfo, OpenAIServing
from kvgate.engine.sim_runner import SimulatedRunner
from kvgate.engine.spec_decode import SpeculativeConfig
from kvgate.testing.otlp import otlp_collector

CYCLE = [300, 301, 302, 303, 304]


class CycleRunner(SimulatedRunner):
    """Says CYCLE over and over, with 400 every 7th token: n-gram drafts are mostly accepted."""

    def _token(self, params: SamplingParams, key: int, pos: int) -> tuple[int, int]:
        return (400 if pos % 7 == 6 else CYCLE[pos % len(CYCLE)]), key


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer("default")


def _attributes(collector: Any, trace_id: str) -> dict[str, Any]:
    (span,) = [s for s in collector.trace(trace_id) if s.name == "kvgate.engine.request"]
    return span.attributes


@pytest.mark.parametrize("speculate", [True, False])
async def test_the_request_span_carries_its_drafts_and_accepted_drafts(
    tokenizer: Any, speculate: bool
) -> None:
    spec = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, adaptive=False
    )
    config = EngineConfig(
        simulate=True,
        simulation=SimulationConfig(time_scale=0.0),
        speculative_config=spec if speculate else None,
    )
    engine = LLMEngine(config, runner=CycleRunner(config, tokenizer), tokenizer=tokenizer)
    with otlp_collector() as collector:
        tracer = Tracer(collector.url, "kvgate-engine")
        metrics = EngineMetrics("m", CacheConfigInfo(16, 64, True))
        async_engine = AsyncEngine(engine, metrics)
        async_engine.start(asyncio.get_running_loop())
        info = ModelInfo(["m"], "m", engine.max_model_len, engine.vocab_size, 0, {})
        state = ServerState(
            OpenAIServing(async_engine, tokenizer, info), async_engine, metrics, "test", tracer=tracer
        )
        traces: dict[bool, str] = {}
        drafted: dict[bool, tuple[int, int, int]] = {}
        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                for stream in (False, True):
                    before = engine.get_stats()
                    trace_id = secrets.token_hex(16)
                    r = await client.post(
                        "/v1/completions",
                        json={
                            "model": "m",
                            "prompt": CYCLE * 2,
                            "max_tokens": 40,
                            "temperature": 0,
                            "ignore_eos": True,
                            "stream": stream,
                        },
                        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
                    )
                    assert r.status_code == 200, r.text
                    after = engine.get_stats()
                    traces[stream] = trace_id
                    drafted[stream] = (
                        after.spec_num_drafts_total - before.spec_num_drafts_total,
                        after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total,
                        after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total,
                    )
        finally:
            await asyncio.to_thread(async_engine.stop)
            tracer.shutdown()  # flushes
        for stream, trace_id in traces.items():
            attributes = _attributes(collector, trace_id)
            keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
            got = tuple(attributes.get(f"kvgate.spec_decode.{k}") for k in keys)
            if not speculate:
                assert got == (None, None, None), attributes  # no speculation: no attributes
                continue
            assert got == drafted[stream], (stream, attributes)
            steps, draft_tokens, accepted = got
            assert steps > 0 and 0 < accepted < draft_tokens, (stream, got)  # some rejected

"""Prefill/decode disaggregation on the real default model, through the gateway:
`kvgate up --prefill-engines 1 --decode-engines 1 --pd-threshold 0` answers greedy requests
token for token like one aggregated engine; the prefill engine computed the prompts and the
decode engine took them from the transfer as cache hits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, engine_gauges, start_up, stop_up
from kvgate.testing.processes import KVGATE, Process, free_port, http_get, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "Explain, step by step, how a paged KV cache lets a server share prompt prefixes. " * 6,
    "List ten facts about the Roman empire, one per line, with a date for each. " * 5,
]
CHATS = [
    [
        {"role": "system", "content": "You are a careful assistant who answers in one paragraph. " * 8},
        {"role": "user", "content": "Why is the sky blue? Mention Rayleigh scattering."},
    ]
]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, str]]:
    tmp = tmp_path_factory.mktemp("pd-real")
    up = start_up(
        tmp,
        "--prefill-engines",
        "1",
        "--decode-engines",
        "1",
        "--pd-threshold",
        "0",
        "--epp-replicas",
        "1",
    )
    port = free_port()
    aggregated = Process(
        "aggregated", [*KVGATE, "engine", "serve", "--port", str(port)], Path(tmp) / "agg.log"
    )
    aggregated.start()
    try:
        up.wait_for_line(r"^curl ", timeout=300)
        eventually(
            lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
            300,
            "aggregated engine",
            watch=[aggregated],
        )
        yield up, f"http://127.0.0.1:{port}/v1"
    finally:
        stop_all(aggregated)
        stop_up(up)


def test_disaggregated_equals_aggregated_token_for_token(stacks: tuple[UpProcess, str]) -> None:
    up, aggregated_url = stacks
    info = up.stack
    prefill, decode = info["prefill_engine_urls"][0], info["decode_engine_urls"][0]
    gateway = openai.OpenAI(base_url=info["gateway_url"] + "/v1", api_key="unused", max_retries=0)
    single = openai.OpenAI(base_url=aggregated_url, api_key="unused", max_retries=0)
    prefill0, decode0 = engine_gauges(prefill), engine_gauges(decode)

    prompt_tokens = 0
    for prompt in PROMPTS:
        kw = {"model": info["model"], "prompt": prompt, "max_tokens": 24, "temperature": 0}
        got, want = gateway.completions.create(**kw), single.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage is not None and want.usage is not None
        prompt_tokens += got.usage.prompt_tokens
    for messages in CHATS:
        kw2 = {"model": info["model"], "messages": messages, "max_tokens": 24, "temperature": 0}
        got_c, want_c = gateway.chat.completions.create(**kw2), single.chat.completions.create(**kw2)
        assert got_c.choices[0].message.content == want_c.choices[0].message.content
        assert got_c.usage is not None
        prompt_tokens += got_c.usage.prompt_tokens

    prefill1, decode1 = engine_gauges(prefill), engine_gauges(decode)
    # the prefill engine computed the prompts (none of them was cached there)...
    computed = prefill1["vllm:prompt_tokens_total"] - prefill0["vllm:prompt_tokens_total"]
    assert computed == prompt_tokens
    # ...and the decode engine found all but each prompt's last partial block in its cache,
    # every one of them pulled from the prefill engine
    hits = decode1["vllm:external_prefix_cache_hits_total"] - decode0.get(
        "vllm:external_prefix_cache_hits_total", 0
    )
    assert hits >= prompt_tokens - 16 * (len(PROMPTS) + len(CHATS))
    assert decode1["vllm:prefix_cache_hits_total"] - decode0["vllm:prefix_cache_hits_total"] >= hits
    assert decode1.get("kvgate:kv_transfer_fallbacks_total", 0) == 0
    text = httpx.get(prefill + "/metrics", timeout=5).text
    assert "kvgate:kv_transfer_pinned_blocks" in text

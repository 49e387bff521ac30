"""`kvgate engine serve` on the real default model (SmolLM2-135M), through the openai client.

Slow (the model loads in ~10-30 s on 2 CPU cores), so one server serves the whole module.
"""

from __future__ import annotations

import signal
import struct
import uuid
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from openai import OpenAI

from kvgate.testing import eventually
from kvgate.testing.engine_server import EngineProcess, launch, subscribe_kv_events

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    srv = launch(
        tmp_path_factory.mktemp("real-engine"),
        "--kv-events-endpoint", "tcp://127.0.0.1:*",
        "--max-model-len", "2048",
        timeout=180,
    )  # fmt: skip
    yield srv
    assert srv.stop(signal.SIGTERM, timeout=30) == 0


@pytest.fixture(scope="module")
def client(server: EngineProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def test_greedy_answer_matches_the_hf_oracle(client: OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"


def test_stream_equals_non_stream_with_usage(client: OpenAI) -> None:
    kw = {"model": "default", "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].usage.completion_tokens >= 7


def test_seeded_sampling_is_reproducible_and_n_differs(client: OpenAI) -> None:
    kw = {"model": "default", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    two = client.completions.create(seed=1234, n=2, **kw)
    assert two.choices[0].text == a and two.choices[1].text != a


def test_logprobs_and_stop_string(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    for pos in r.choices[0].logprobs.content:
        tops = [t.logprob for t in pos.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert pos.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
    stopped = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=16, temperature=0, stop=["Paris"]
    )
    assert stopped.choices[0].message.content == "The capital of France is "
    assert stopped.choices[0].finish_reason == "stop"


def test_kv_events_carry_the_tokenized_prompt(server: EngineProcess, client: OpenAI) -> None:
    assert server.kv_endpoint is not None

    def poke() -> None:  # a new block of its own: shares nothing with the chat below
        prompt = f"{uuid.uuid4().hex} " * 8
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)

    sub = subscribe_kv_events(server.kv_endpoint, poke, topic=b"")
    messages = [{"role": "user", "content": "Explain the water cycle in simple words, step by step, please."}]
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)
    # Blocks already cached (the template's system prompt, shared with earlier tests) are not re-stored.
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0
    stored: list[int] = []
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        assert topic.decode().startswith("kv@127.0.0.1:") and topic.decode().endswith("@default")
        struct.unpack(">Q", seq)
        for event in msgpack.unpackb(payload)[1]:
            if event[0] == "BlockStored":
                stored += event[3]
    full = len(ids) // 16 * 16
    assert full - cached >= 16 and stored[: full - cached] == ids[cached:full]
    sub.close()


def test_disconnect_frees_blocks(server: EngineProcess) -> None:
    body = {
        "prompt": "Write a long essay about the sea.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert server.metrics()["vllm:kv_cache_usage_perc"] > 0

    def freed() -> bool:
        m = server.metrics()
        return m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0

    eventually(freed, 10, "the disconnected request's blocks freed")

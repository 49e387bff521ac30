"""The official `openai` client against a real simulated `kvgate engine serve` process."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from kvgate.testing.engine_server import EngineProcess

from .conftest import API_KEY

MODEL = "sim-model"


def _chat(client: OpenAI, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Tell me about Paris."}])
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, **kw)


def test_models_carry_max_model_len(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "sim-alias"]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_retrieve_model(client: OpenAI, sim_engine: EngineProcess) -> None:
    for name in (MODEL, "sim-alias"):
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "kvgate")
        assert m.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    error = _error(info.value)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-model" in error["message"]
    # the API key guards it like the list
    r = httpx.get(f"{sim_engine.base_url}/v1/models/{MODEL}")
    assert r.status_code == 401


def test_retrieve_model_with_a_slash_in_its_id(engine_factory) -> None:
    eng = engine_factory("--simulate", "--served-model-name", "org/sim-model")
    c = OpenAI(base_url=f"{eng.base_url}/v1", api_key="x", max_retries=0, timeout=30)
    assert c.models.retrieve("org/sim-model").id == "org/sim-model"  # sent as org%2Fsim-model
    assert httpx.get(f"{eng.base_url}/v1/models/org/sim-model").json()["id"] == "org/sim-model"
    assert httpx.get(f"{eng.base_url}/v1/models/org").status_code == 404


def test_alias_is_served_under_the_primary_name(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="sim-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.model == MODEL


def test_chat_completion(client: OpenAI) -> None:
    r = _chat(client, seed=7)
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_without_max_tokens_ends_on_its_own(client: OpenAI) -> None:
    # Unset max_tokens means "up to the context", but the (simulated) model stops with EOS first,
    # as a real one would; it must not be turned into a fixed length of the whole context.
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], seed=3
    )
    assert r.choices[0].finish_reason == "stop"
    assert 1 <= r.usage.completion_tokens < 1024 - r.usage.prompt_tokens


def test_chat_stream_with_usage_matches_non_stream(client: OpenAI) -> None:
    full = _chat(client, seed=11).choices[0].message.content
    chunks = list(_chat(client, seed=11, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(client: OpenAI) -> None:
    chunks = list(_chat(client, stream=True))
    assert all(c.choices for c in chunks)


def test_completions_prompt_forms(client: OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, seed=3)
    assert one.object == "text_completion" and len(one.choices) == 1
    assert one.usage.completion_tokens == 4
    many = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=4, seed=3)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text  # same prompt, same seed
    assert many.usage.completion_tokens == 8
    ids = client.completions.create(model=MODEL, prompt=[1000, 2000, 3000], max_tokens=3)
    assert ids.usage.prompt_tokens == 3
    batch = client.completions.create(model=MODEL, prompt=[[1000, 2000], [3000]], max_tokens=2)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 3


def test_completion_stream_and_echo(client: OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, seed=5).choices[0].text
    chunks = list(
        client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, seed=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    echoed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, seed=5, echo=True)
    assert echoed.choices[0].text == "The sky is" + full


def test_n_choices(client: OpenAI) -> None:
    r = _chat(client, n=2, seed=1, max_tokens=6)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 12
    # choice 0 of n=2 with seed s is the n=1 answer with seed s; choice 1 uses seed s+1
    assert _chat(client, seed=1, max_tokens=6).choices[0].message.content == r.choices[0].message.content
    assert _chat(client, seed=2, max_tokens=6).choices[0].message.content == r.choices[1].message.content
    chunks = list(
        _chat(client, n=2, seed=1, max_tokens=6, stream=True, stream_options={"include_usage": True})
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert chunks[-1].usage.completion_tokens == 12


def test_seed_reproducibility(client: OpenAI) -> None:
    a = _chat(client, seed=42, temperature=0.8).choices[0].message.content
    b = _chat(client, seed=42, temperature=0.8).choices[0].message.content
    c = _chat(client, seed=43, temperature=0.8).choices[0].message.content
    assert a == b and a != c


def test_stop_strings(client: OpenAI) -> None:
    text = _chat(client, seed=9, max_tokens=10).choices[0].message.content
    words = text.split()
    stop = " " + words[3]
    expected = text[: text.index(stop)]
    r = _chat(client, seed=9, max_tokens=10, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(_chat(client, seed=9, max_tokens=10, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    kept = _chat(client, seed=9, max_tokens=10, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == expected + stop


def test_chat_logprobs(client: OpenAI) -> None:
    r = _chat(client, logprobs=True, top_logprobs=3, max_tokens=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.bytes == list(t.token.encode())
    chunks = list(_chat(client, logprobs=True, top_logprobs=2, max_tokens=4, stream=True))
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert len(streamed) == 4 and all(len(t.top_logprobs) == 2 for t in streamed)


def test_completion_logprobs(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def test_max_completion_tokens_and_ignore_eos(client: OpenAI) -> None:
    r = _chat(client, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_unknown_fields_are_tolerated(client: OpenAI) -> None:
    r = _chat(client, extra_body={"some_future_field": {"x": 1}}, user="u1", metadata={"a": "b"}, store=False)
    assert r.choices[0].message.content


# ---- errors ------------------------------------------------------------------------------


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ],
)
def test_out_of_range_parameters_are_400(client: OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kwargs)
    err = _error(info.value)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_prompt_over_the_context_is_400(client: OpenAI) -> None:
    long_prompt = " hello" * 1500
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 1024" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2000)
    assert _error(info.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, messages=[{"role": "user", "content": long_prompt}], stream=True)
    assert _error(info.value)["code"] == "context_length_exceeded"


def test_out_of_vocabulary_token_ids_are_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=1)
    assert "out of range" in _error(info.value)["message"]


def test_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    err = _error(info.value)
    assert err["code"] == "model_not_found" and "nope" in err["message"]


def test_wrong_or_missing_api_key_is_401(sim_engine: EngineProcess) -> None:
    bad = OpenAI(base_url=f"{sim_engine.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert _error(info.value)["code"] == "invalid_api_key"
    r = httpx.post(f"{sim_engine.base_url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    # health and metrics stay open for probes and scrapers
    assert httpx.get(f"{sim_engine.base_url}/health").status_code == 200
    assert httpx.get(f"{sim_engine.base_url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "sim-model"}', "Missing required field 'prompt'"),
        (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "x", "n": 1.5}', "'n'"),
        (b'{"prompt": "x", "logprobs": 99}', "logprobs"),
        (b'{"prompt": ""}', "empty"),
        (b'{"prompt": []}', "empty"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix"),
        (b'{"prompt": "x", "best_of": 3}', "best_of"),
        (json.dumps({"prompt": ["x"] * 100, "n": 20}).encode(), "sequences in one request"),
    ],
)
def test_bad_completion_bodies_are_400(sim_engine: EngineProcess, body: bytes, needle: str) -> None:
    r = httpx.post(
        f"{sim_engine.base_url}/v1/completions",
        content=body,
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_unknown_route_and_method(sim_engine: EngineProcess) -> None:
    r = httpx.get(f"{sim_engine.base_url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{sim_engine.base_url}/v1/completions", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 405 and "error" in r.json()


# ---- the other routes ----------------------------------------------------------------------


def test_tokenize_detokenize_roundtrip(sim_engine: EngineProcess) -> None:
    auth = {"authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{sim_engine.base_url}/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    back = httpx.post(f"{sim_engine.base_url}/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(
        f"{sim_engine.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": "Hello world"}], "return_token_strs": True},
        headers=auth,
    ).json()
    assert chat["count"] > r["count"] and len(chat["token_strs"]) == chat["count"]
    bad = httpx.post(f"{sim_engine.base_url}/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad.status_code == 400


def test_request_id_is_echoed(sim_engine: EngineProcess) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", "x-request-id": "abc-123"}
    body = {"prompt": "x", "max_tokens": 1}
    r = httpx.post(f"{sim_engine.base_url}/v1/completions", json=body, headers=headers)
    assert r.headers["x-request-id"] == "abc-123"
    with httpx.stream(
        "POST", f"{sim_engine.base_url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as s:
        assert s.headers["x-request-id"] == "abc-123"
    bad = httpx.post(f"{sim_engine.base_url}/v1/completions", json={}, headers=headers)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "abc-123"


def test_health_ping_version_openapi(sim_engine: EngineProcess) -> None:
    base = sim_engine.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping").status_code == 200
    assert httpx.get(f"{base}/version").json()["version"]
    doc = httpx.get(f"{base}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/metrics"):
        assert path in doc["paths"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]

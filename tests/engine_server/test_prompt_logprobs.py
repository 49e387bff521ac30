"""Prompt logprobs (echo + logprobs, max_tokens=0, vLLM's prompt_logprobs) on a real
`kvgate engine serve` of the default model, checked against Hugging Face transformers'
log-softmax of the same GGUF weights (both fp32 on CPU; tolerance 1e-3).

The server prefills in 32-token chunks (--max-num-batched-tokens 32), so every prompt here
spans several chunks, and prefix caching is on (the engine's default).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI

from kvgate.api.tokenizer import load_tokenizer
from kvgate.testing.engine_server import EngineProcess, launch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

ATOL = 1e-3
MODEL = "default"
TEXT = (
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, "
    "benches and a playground, and the council agreed to fund the trees this year."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    srv = launch(
        tmp_path_factory.mktemp("prompt-logprobs"),
        "--max-model-len", "512",
        "--max-num-batched-tokens", "32",
        "--cpu-threads", "1",
        timeout=180,
    )  # fmt: skip
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server: EngineProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def reference(hf_default_model: Any) -> Any:
    torch.set_num_threads(1)  # shared cores
    return hf_default_model


def hf_logprobs(reference: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the log-distribution of token p given tokens < p (row 0 unused)."""
    with torch.inference_mode():
        logits = reference(torch.tensor([ids])).logits[0].float()
    out = torch.full_like(logits, float("nan"))
    out[1:] = logits[:-1].log_softmax(-1)
    return out


def check_prompt_logprobs(entries: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: None first, then {token_id: {logprob, rank, decoded_token}} with the actual
    token (at its true rank) and the top-k."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[p].items()}
        actual = entry[ids[p]]
        assert actual["logprob"] == pytest.approx(ref[p, ids[p]].item(), abs=ATOL)
        assert actual["rank"] == int((ref[p] > ref[p, ids[p]]).sum()) + 1
        top = ref[p].topk(k)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert entry[tid]["rank"] == rank and entry[tid]["logprob"] == pytest.approx(lp, abs=ATOL)
            assert isinstance(entry[tid]["decoded_token"], str)
        assert set(entry) <= {ids[p], *top.indices.tolist()}


def test_echo_logprobs_max_tokens_zero_match_transformers(
    client: OpenAI, tokenizer: Any, reference: Any
) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 32  # several prefill chunks
    ref = hf_logprobs(reference, ids)
    r = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(ids)  # the prompt alone
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p, ids[p]].item(), abs=ATOL)
        assert lp.tokens[p] in lp.top_logprobs[p] and 2 <= len(lp.top_logprobs[p]) <= 3
        assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p].max().item(), abs=ATOL)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_lm_eval_loglikelihood_request(client: OpenAI, tokenizer: Any, reference: Any) -> None:
    """lm-eval-harness's local-completions scoring call: token-id prompt, echo, logprobs=1,
    max_tokens=1, temperature 0; it reads token_logprobs[ctxlen:-1] and top_logprobs there."""
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris.")
    ids = context + continuation
    ref = hf_logprobs(reference, ids)
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the one generated token
    scored = lp.token_logprobs[len(context) : -1]
    expected = [ref[p, ids[p]].item() for p in range(len(context), len(ids))]
    assert scored == pytest.approx(expected, abs=ATOL)
    for tok, top in zip(scored, lp.top_logprobs[len(context) : -1], strict=True):
        assert isinstance(top, dict) and tok <= max(top.values()) + 1e-6


def test_prompt_logprobs_on_completions(client: OpenAI, tokenizer: Any, reference: Any) -> None:
    ids = tokenizer.encode(TEXT)
    r = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], ids, hf_logprobs(reference, ids), 3)


def test_prompt_logprobs_on_chat(client: OpenAI, server: EngineProcess, reference: Any) -> None:
    messages = [{"role": "user", "content": "Write one sentence about the sea and the wind."}]
    ids = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages}).json()[
        "tokens"
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    assert r.usage.prompt_tokens == len(ids)
    check_prompt_logprobs(r.model_extra["prompt_logprobs"], ids, hf_logprobs(reference, ids), 2)


def test_prefix_cached_prompt_is_recomputed_only_when_asked(
    client: OpenAI, tokenizer: Any, reference: Any
) -> None:
    text = "A fresh prompt for the cache test. " + TEXT + " Then the meeting ended."
    ids = tokenizer.encode(text)
    kw: dict[str, Any] = {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}
    client.completions.create(**kw)  # fills the prefix cache
    asked = client.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    assert asked.usage.prompt_tokens_details.cached_tokens == 0  # recomputed for its logprobs
    check_prompt_logprobs(
        asked.choices[0].model_extra["prompt_logprobs"], ids, hf_logprobs(reference, ids), 1
    )
    again = client.completions.create(**kw)  # not asking: the cache serves it
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ],
)
def test_out_of_range_is_a_400(
    server: EngineProcess, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": MODEL, "prompt": "Hello", **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"

"""Prompt-logprob requests (echo + logprobs + max_tokens=0, prompt_logprobs on both APIs)
through real Envoy + the EPP to a simulated engine: routed like any request, bodies untouched,
the engine's answer (and its 400s) passed back as they are."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway-prompt-logprobs")
    with harness.gateway_stack(logs, engines=1, engine_args=("--served-model-name", "default")) as (
        _,
        _,
        envoy,
    ):
        yield envoy


def test_prompt_logprob_requests_pass_through_the_gateway(gateway) -> None:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30)
    prompt = "The quick brown fox jumps over the lazy dog."
    r = client.completions.create(model="default", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == r.usage.prompt_tokens and all(
        x is not None for x in lp.token_logprobs[1:]
    )

    c = client.completions.create(
        model="default", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    entries = c.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == c.usage.prompt_tokens and entries[0] is None

    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None

    bad = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 0}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

from __future__ import annotations

import time

import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.request import InferenceRequest


class CharTokenizer:
    """One token per character: enough to key prefixes in unit tests (the real one is tested e2e)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture
def store() -> Datastore:
    ds = Datastore()
    ds.set_endpoints([Endpoint(f"10.0.0.{i}:8000") for i in range(1, 4)])
    for st in ds.all():
        ds.update_metrics(st.address, EndpointMetrics(updated_at=time.monotonic()))
    return ds


def make_request(prompt: str = "hello world", model: str = "m", **kw) -> InferenceRequest:
    body = {"model": model, "prompt": prompt}
    return InferenceRequest(
        request_id="r1", model=model, target_model=model, body=body, tokenizer=CharTokenizer(), **kw
    )


@pytest.fixture
def req():
    return make_request


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()

"""What the EPP's scheduling tests share (tests/epp/, tests/epp/plugins/): a one-token-per-character
tokenizer, a request made with it, a scheduling context, scraped metrics set on an endpoint."""

from __future__ import annotations

import time
from typing import Any

from kvgate.epp.datastore import Datastore, EndpointMetrics
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.framework import SchedulingContext


class CharTokenizer:
    """One token per character: enough to key prefixes in unit tests (the real one is tested e2e)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def make_request(prompt: str = "hello world", model: str = "m", **kw: Any) -> InferenceRequest:
    body = {"model": model, "prompt": prompt}
    tokenizer: Any = CharTokenizer()  # what the prompt path calls of a tokenizer, no more
    return InferenceRequest(
        request_id="r1", model=model, target_model=model, body=body, tokenizer=tokenizer, **kw
    )


def ctx_for(store: Datastore, request: InferenceRequest | None = None) -> SchedulingContext:
    return SchedulingContext(request or make_request(), store, time.monotonic())


def set_metrics(store: Datastore, address: str, **kw: Any) -> None:
    store.update_metrics(address, EndpointMetrics(updated_at=time.monotonic(), **kw))

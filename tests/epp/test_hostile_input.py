"""Hostile request bodies are refused by the EPP before they cost it memory or time, with the
real tokenizer where the tokenizer is what broke (the gateway path is e2e/test_attacks.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.extproc import EndpointPickerHandler, _Exchange
from kvgate.epp.metrics import UNKNOWN_MODEL, EppMetrics
from kvgate.epp.request import PromptPolicy
from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector

from .test_extproc import body_msg, headers_msg, run, set_headers

ADDRS = ["10.0.0.1:8000", "10.0.0.2:8000"]


@pytest.fixture(scope="module")
def real_tokenizer():
    from kvgate.epp.tokenization import load

    return load("default")


def make_handler(tokenizer, policy: PromptPolicy | None = None, **kwargs) -> EndpointPickerHandler:
    ds = Datastore()
    ds.set_endpoints([Endpoint(a) for a in ADDRS])
    for a in ADDRS:
        ds.update_metrics(a, EndpointMetrics(updated_at=time.monotonic() + 3600))
    cfg = load_config(None, "precise-prefix")
    director = Director(ds, build_profiles(cfg)[0], saturation_detector(cfg))
    return EndpointPickerHandler(director, EppMetrics(ds), tokenizer, policy=policy, **kwargs)


def send(handler, body: bytes | dict, headers: dict[str, str] | None = None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return run(
        handler, headers_msg({":path": "/v1/chat/completions", **(headers or {})}), body_msg(raw, True)
    )


def error(out: list[ep.ProcessingResponse], status: int) -> dict:
    assert out and out[0].HasField("immediate_response"), out
    imm = out[0].immediate_response
    assert imm.status.code == status
    return json.loads(imm.body)["error"]


def chat(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def test_request_template_refused_without_trust(real_tokenizer) -> None:
    handler = make_handler(real_tokenizer)
    attack = "{% set s = 'x' * 1000000000 %}{{ s|length }}"
    for body in (
        chat("hi", chat_template=attack),
        chat("hi", chat_template_kwargs={"chat_template": attack}),
    ):
        t0 = time.monotonic()
        err = error(send(handler, body)[1], 400)
        assert "--trust-request-chat-template" in err["message"]
        assert err["param"] == "chat_template"
        assert time.monotonic() - t0 < 1


def test_trusted_request_template_is_bounded(real_tokenizer) -> None:
    handler = make_handler(real_tokenizer, PromptPolicy(trust_request_chat_template=True))
    ok = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    _, out = send(handler, chat("hi", chat_template=ok))
    assert out[0].HasField("request_headers")
    loops = "{% for a in range(550) %}{% for b in range(550) %}{% for c in range(550) %}{% endfor %}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    err = error(send(handler, chat("hi", chat_template=loops))[1], 400)
    assert "chat template" in err["message"]
    assert time.monotonic() - t0 < 15


def test_deep_nesting_and_lone_surrogate_are_400(real_tokenizer) -> None:
    handler = make_handler(real_tokenizer)
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested" in error(send(handler, deep)[1], 400)["message"]
    surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    error(send(handler, surrogate)[1], 400)
    prompt = b'{"model": "m", "prompt": "a\\udfffb"}'
    error(send(handler, prompt)[1], 400)


def test_over_context_refused_before_tokenizing(real_tokenizer) -> None:
    handler = make_handler(real_tokenizer, PromptPolicy(max_model_len=8192))
    calls = []
    base_encode = real_tokenizer.base.encode
    real_tokenizer.base.encode = lambda *a, **k: calls.append(1) or base_encode(*a, **k)
    try:
        text = "lorem ipsum " * 500_000  # 6 MB
        t0 = time.monotonic()
        err = error(send(handler, {"model": "m", "prompt": text})[1], 400)
        assert err["code"] == "context_length_exceeded"
        assert time.monotonic() - t0 < 2
        assert calls == []  # refused from its length alone
        # under the cheap bound but over the context once tokenized: still a 400
        err = error(send(handler, {"model": "m", "prompt": "1" * 100_000})[1], 400)
        assert err["code"] == "context_length_exceeded"
    finally:
        real_tokenizer.base.encode = base_encode


def test_body_over_the_limit_is_413_as_it_arrives(char_tokenizer) -> None:
    handler = make_handler(char_tokenizer, max_body_bytes=1000)
    x = _Exchange()
    handler.handle(x, headers_msg({":path": "/v1/completions"}))
    assert handler.handle(x, body_msg(b"x" * 600, False)) == []
    out = handler.handle(x, body_msg(b"x" * 600, False))  # not end of stream yet: refused already
    assert error(out, 413)["code"] == "body_too_large"
    assert len(x.body) == 600


def test_forged_request_ids_are_replaced(char_tokenizer) -> None:
    handler = make_handler(char_tokenizer)
    for rid, kept in (("abc-123", True), ("r" * 8000, False), ("bad id\r\nx", False)):
        x, out = send(handler, {"model": "m", "prompt": "hi"}, {"x-request-id": rid})
        assert (x.request_id == rid) is kept
        if not kept:
            assert len(set_headers(out[0])["x-request-id"]) <= 128


def test_random_model_names_collapse_into_one_label(char_tokenizer) -> None:
    handler = make_handler(char_tokenizer)
    ds = handler.director.datastore
    for s in ds.all():
        s.served_models = frozenset({"served-model"})
    metrics = handler.metrics
    assert metrics is not None
    from prometheus_client import generate_latest

    send(handler, {"model": "served-model", "prompt": "warm"})
    size0 = len(generate_latest(metrics.registry))
    for i in range(3000):
        send(handler, {"model": f"m-{uuid.uuid4().hex}", "prompt": f"x{i}"})
    page = generate_latest(metrics.registry).decode()
    assert 'model_name="served-model"' in page
    assert f'model_name="{UNKNOWN_MODEL}"' in page
    assert len(page) < size0 + 20_000, len(page)


def test_large_bodies_are_prepared_off_the_event_loop(real_tokenizer) -> None:
    """A large prompt is tokenized in a worker thread: the loop keeps ticking meanwhile."""
    from kvgate.epp.extproc import _completes_large_body

    handler = make_handler(real_tokenizer, PromptPolicy(max_model_len=1_000_000))
    text = " ".join(f"w{i} {uuid.uuid4().hex[:8]}" for i in range(60_000))  # ~1 MB, ~300k tokens
    raw = json.dumps({"model": "m", "prompt": text}).encode()

    async def main() -> tuple[list[ep.ProcessingResponse], float]:
        x = _Exchange()
        handler.handle(x, headers_msg({":path": "/v1/completions"}))
        msg = body_msg(raw, True)
        assert _completes_large_body(handler, x, msg)
        gaps: list[float] = []
        done = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        out = await handler.finish_body_async(x, msg)
        took = time.perf_counter() - t0
        done = True
        await tick
        return out, max(gaps) / took if gaps else 1.0

    out, worst_gap_share = asyncio.run(main())
    assert out[0].HasField("request_headers")
    # the loop was never held for more than a fraction of the tokenization (GIL released)
    assert worst_gap_share < 0.5, worst_gap_share

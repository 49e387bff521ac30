"""The segment cache must be exactly the tokenizer's own encoding (the engine uses the latter)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp.request import InferenceRequest
from kvgate.epp.tokenization import SegmentCachingTokenizer


@pytest.fixture(scope="module")
def real():
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def cached(real):
    tok = SegmentCachingTokenizer(real)
    assert tok.segment_cache_enabled
    return tok


_text = st.lists(
    st.sampled_from(
        [*"ab cd\n\t.,!?é中🙂'\"<>|_", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "im_", "<|im"]
    ),
    max_size=40,
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_text, max_size=6), special=st.booleans())
def test_segment_cache_equals_full_encode(real, cached, parts, special) -> None:
    text = "".join(parts)
    assert cached.encode(text, add_special_tokens=special) == real.encode(text, add_special_tokens=special)
    assert cached.encode(text, add_special_tokens=special) == real.encode(
        text, add_special_tokens=special
    )  # from cache


def test_chat_request_tokens_match_the_engine_path(real, cached) -> None:
    messages = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    body = {"model": "default", "messages": messages}
    req = InferenceRequest("r", "default", "default", body, tokenizer=cached)
    # what the engine does: template over {role, content text}, encode without special tokens
    convo = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi there"}]
    expected = real.encode(
        real.apply_chat_template(convo, add_generation_prompt=True), add_special_tokens=False
    )
    assert req.token_ids == expected
    before = cached.hits
    assert InferenceRequest("r2", "default", "default", body, tokenizer=cached).token_ids == expected
    assert cached.hits > before


def test_completion_prompt_honours_add_special_tokens(real, cached) -> None:
    for flag in (True, False):
        body = {"model": "default", "prompt": "Once upon a time", "add_special_tokens": flag}
        req = InferenceRequest("r", "default", "default", body, tokenizer=cached)
        assert req.token_ids == real.encode("Once upon a time", add_special_tokens=flag)
    ids = [5, 6, 7]
    assert InferenceRequest("r", "m", "m", {"model": "m", "prompt": ids}, tokenizer=cached).token_ids == ids

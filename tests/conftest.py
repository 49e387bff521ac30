"""Fixtures shared by every module under tests/: loaded once per run, not once per module."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def hf_default_model() -> Any:
    """The default model as transformers loads it from the GGUF the engine serves: the
    token-for-token oracle (~10 s to load). Shared: a test must not change it."""
    import torch
    import transformers

    from kvgate.api.tokenizer import resolve_model

    path = resolve_model("default")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tok() -> Any:
    """The default model's tokenizer (SmolLM2's), shared by every test that counts tokens."""
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer("default")

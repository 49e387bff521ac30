"""Tiny random-weight Llama / Qwen2 / Qwen3 built with transformers, loaded by our loader from a
saved HF folder, must give the same logits and the same greedy tokens as transformers (fp32).

Tolerance: logits within 1e-4 absolute (fp32; only the summation order of matmuls differs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.layers.attention import build_attention_metadata
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.testing.runner_driver import drive

transformers = pytest.importorskip("transformers")

VOCAB = 256
LOGIT_ATOL = 1e-4
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,  # peaked distributions: greedy ties would make the comparison meaningless
    rms_norm_eps=1e-5,
)

VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-tied-linear-rope-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True
        ),
    ),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    # The test machine's cores are shared; two spinning OpenMP threads per process under load are
    # 10-20x slower than one.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _build(variant: str, folder: Path) -> Any:
    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(1234)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).float().eval()
    if variant.startswith("qwen"):
        # HF initialises biases and q/k norms to zero/one; randomise them so they are really tested.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias") or "q_norm" in name or "k_norm" in name:
                    p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, TorchModelRunner]:
    folder = tmp_path_factory.mktemp(request.param)
    reference = _build(request.param, folder)
    runner = TorchModelRunner(
        EngineConfig(model=str(folder), device="cpu", block_size=4, num_kv_blocks=96), progress=False
    )
    return reference, runner


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19, 40)]


def _hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :], logits


def test_logits_match_transformers(pair: tuple[Any, TorchModelRunner]) -> None:
    reference, runner = pair
    prompt = _prompts()[3]
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0]
        # The whole prompt in one step over freshly allocated (non-contiguous) blocks.
        blocks = list(range(runner.num_kv_blocks - 1, runner.num_kv_blocks - 1 - 10, -1))
        meta, positions = build_attention_metadata([len(prompt)], [0], [blocks], 4, runner.device, True)
        hidden = runner.model(torch.tensor(prompt), positions, runner.kv_caches, meta)
        got = runner.model.compute_logits(hidden)
    torch.testing.assert_close(got, expected, rtol=0, atol=LOGIT_ATOL)


def test_greedy_matches_transformers_with_chunked_prefill_and_batched_decode(
    pair: tuple[Any, TorchModelRunner],
) -> None:
    reference, runner = pair
    prompts = _prompts()
    steps = 12
    ours = drive(runner, prompts, steps, chunk=7)
    for prompt, samples in zip(prompts, ours, strict=True):
        expected, _ = _hf_greedy(reference, prompt, steps)
        assert [s.token_id for s in samples] == expected

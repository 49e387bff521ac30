"""A LoRA adapter's weights changing under its name, on the REAL default model (fp32, CPU):
after the reload the engine's greedy output equals a fresh engine's with the new adapter, not
one that reused prefix-cache KV computed with the old weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvgate.api.lora import lora_int_id
from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

BS = 4
PROMPT = "The lighthouse keeper wrote in his log every night, and on the last night he wrote"


@pytest.fixture(scope="module")
def runner() -> TorchModelRunner:
    config = EngineConfig(device="cpu", block_size=BS, num_kv_blocks=128, enable_lora=True, max_lora_rank=4)
    return TorchModelRunner(config, progress=False)


def _adapter(folder: Path, runner: TorchModelRunner, seed: int) -> str:
    """A random rank-4 PEFT adapter on k_proj and v_proj (so it changes the KV itself)."""
    cfg = runner.model_config
    kv_out = cfg.num_kv_heads * cfg.head_dim
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in ("k_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, cfg.hidden_size, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(kv_out, 4, generator=gen) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    conf = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _engine(runner: TorchModelRunner) -> LLMEngine:
    config = EngineConfig(device="cpu", block_size=BS, num_kv_blocks=128, enable_lora=True, max_lora_rank=4)
    return LLMEngine(config, runner=runner, tokenizer=runner.tokenizer)


def _greedy(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(rid, prompt, params, lora_id=lora_int_id("x"))
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, cached = out.token_ids, out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("how", ["other path", "load_inplace"])
def test_output_after_new_weights_equals_a_fresh_engines(
    runner: TorchModelRunner, tmp_path: Path, how: str
) -> None:
    old = _adapter(tmp_path / "old", runner, seed=1)
    new = _adapter(tmp_path / "new", runner, seed=2)
    prompt = runner.tokenizer.encode(PROMPT)
    assert len(prompt) > 4 * BS

    fresh = _engine(runner)
    fresh.add_lora("x", fresh.load_lora("x", new))
    want, _ = _greedy(fresh, "fresh", prompt)

    engine = _engine(runner)
    engine.add_lora("x", engine.load_lora("x", old))
    before, _ = _greedy(engine, "old", prompt)
    assert before != want, "the two adapters must give different outputs, or this proves nothing"
    assert _greedy(engine, "old-again", prompt)[1] > 0  # its prefix is cached
    if how == "other path":
        engine.add_lora("x", engine.load_lora("x", new))
    else:  # the new files written over the old adapter's folder, loaded again in place
        shutil.copytree(new, old, dirs_exist_ok=True)
        engine.add_lora("x", engine.load_lora("x", old), inplace=True)
    got, cached = _greedy(engine, "new", prompt)
    assert cached == 0
    assert got == want

"""Speculative decoding with a LoRA adapter, on the REAL default model (fp32, CPU): greedy
output with n-gram drafts equals the output without, for an adapter request and a base
request in the same batch (verification applies each sequence's adapter to its drafts too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvgate.api.lora import lora_int_id
from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode import SpeculativeConfig

pytestmark = pytest.mark.slow

BS = 16
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity."
)
# drafts every step the proposal allows, so the adapter's verification path surely runs
FIXED = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1, adaptive=False)


def _config(spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        device="cpu",
        block_size=BS,
        max_model_len=1024,
        num_kv_blocks=128,
        enable_lora=True,
        max_lora_rank=4,
        speculative_config=spec,
    )


@pytest.fixture(scope="module")
def runner() -> TorchModelRunner:
    return TorchModelRunner(_config(None), progress=False)


def _adapter(folder: Path, runner: TorchModelRunner) -> str:
    """A random rank-4 PEFT adapter on q_proj and v_proj."""
    cfg = runner.model_config
    outs = {"q_proj": cfg.num_heads * cfg.head_dim, "v_proj": cfg.num_kv_heads * cfg.head_dim}
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, d_out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, cfg.hidden_size, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, 4, generator=gen) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    conf = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": list(outs)}
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _run(
    runner: TorchModelRunner, spec: SpeculativeConfig | None, path: str
) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(_config(spec), runner=runner, tokenizer=runner.tokenizer)
    engine.add_lora("x", engine.load_lora("x", path))
    tok = runner.tokenizer
    prompt = list(
        tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly:\n\n{PASSAGE}"}]))
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine.add_request("lora", prompt, params, lora_id=lora_int_id("x"))
    engine.add_request("base", prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return out, engine


def test_greedy_lora_output_with_speculation_equals_without(runner: TorchModelRunner, tmp_path: Path) -> None:
    path = _adapter(tmp_path / "a", runner)
    plain, _ = _run(runner, None, path)
    spec, engine = _run(runner, FIXED, path)
    assert plain["lora"] != plain["base"], "the adapter must change the output, or this proves nothing"
    assert spec == plain
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens_total > 0

"""Loader edge cases: GGUF header parsing, llama.cpp's Q/K permutation, config parsing, clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgate.api.tokenizer import resolve_model
from kvgate.engine.config import EngineConfig
from kvgate.engine.loader.gguf_file import hf_name, unpermute_qk
from kvgate.engine.loader.gguf_reader import GGUFFile, GGUFFormatError, SkippedArray
from kvgate.engine.loader.hf import open_hf_folder
from kvgate.engine.model_runner import RunnerConfigError, TorchModelRunner, pick_device, pick_dtype
from kvgate.engine.models.config import UnsupportedModelError, model_config_from_hf
from kvgate.engine.models.llama import WeightLoadError

TINY = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows (the spec we invert)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 16 * 5, dtype=np.float32).reshape(8 * 16, 5)
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, 8), 8), w)
    bias = np.arange(4 * 8, dtype=np.float32)
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(bias, 4), 4), bias)


def test_gguf_names_map_to_hf() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def test_gguf_header_of_the_default_model() -> None:
    g = GGUFFile(resolve_model("default"))
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.block_count"] == 30
    assert g.metadata["tokenizer.ggml.tokens"] == SkippedArray(49152)
    assert g.tensors["token_embd.weight"].shape == (49152, 576)
    q = g.dequantize("blk.0.attn_q.weight")
    assert q.shape == (576, 576) and q.dtype == np.float32 and np.isfinite(q).all()


def _gguf_bytes(kv: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kv))
    for key, vtype, payload in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
    return out


def test_gguf_reader_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        GGUFFile(bad)
    bad.write_bytes(_gguf_bytes([], version=9))
    with pytest.raises(GGUFFormatError, match="version 9"):
        GGUFFile(bad)
    full = _gguf_bytes([("general.architecture", 8, struct.pack("<Q", 5) + b"llama")])
    bad.write_bytes(full[:-3])
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(bad)
    bad.write_bytes(full)
    assert GGUFFile(bad).metadata == {"general.architecture": "llama"}


def test_hf_config_variants_and_errors() -> None:
    v4 = model_config_from_hf({**TINY, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    v5 = model_config_from_hf(
        {**TINY, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    )
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling.kind == "linear"
    qwen2 = model_config_from_hf({**TINY, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    assert model_config_from_hf({**TINY, "model_type": "qwen3", "head_dim": 16}).qk_norm
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*not supported"):
        model_config_from_hf({**TINY, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        model_config_from_hf({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        model_config_from_hf({k: v for k, v in TINY.items() if k != "hidden_size"})


def _folder_with(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _tiny_tensors() -> dict[str, torch.Tensor]:
    t = {
        "model.embed_tokens.weight": torch.randn(64, 32),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32),
    }
    p = "model.layers.0."
    for name, shape in {
        "input_layernorm.weight": (32,),
        "post_attention_layernorm.weight": (32,),
        "self_attn.q_proj.weight": (32, 32),
        "self_attn.k_proj.weight": (16, 32),
        "self_attn.v_proj.weight": (16, 32),
        "self_attn.o_proj.weight": (32, 32),
        "mlp.gate_proj.weight": (48, 32),
        "mlp.up_proj.weight": (48, 32),
        "mlp.down_proj.weight": (32, 48),
    }.items():
        t[p + name] = torch.randn(shape)
    return t


def test_missing_and_misshapen_tensors_are_reported(tmp_path: Path) -> None:
    tensors = _tiny_tensors()
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensors.*qkv_proj.weight#2"):
        TorchModelRunner(
            EngineConfig(model=str(_folder_with(tmp_path / "a", tensors)), num_kv_blocks=4), progress=False
        )
    tensors = _tiny_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(40, 32)
    with pytest.raises(WeightLoadError, match=r"up_proj.weight.*\(40, 32\).*\(48, 32\)"):
        TorchModelRunner(
            EngineConfig(model=str(_folder_with(tmp_path / "b", tensors)), num_kv_blocks=4), progress=False
        )
    tensors = _tiny_tensors()
    tensors["model.layers.0.self_attn.rogue.weight"] = torch.randn(2)
    with pytest.raises(WeightLoadError, match="rogue"):
        TorchModelRunner(
            EngineConfig(model=str(_folder_with(tmp_path / "c", tensors)), num_kv_blocks=4), progress=False
        )


def test_folder_without_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match=r"no \.safetensors.*convert"):
        open_hf_folder(tmp_path)


def test_runner_limits_and_pool_sizing(tmp_path: Path) -> None:
    folder = _folder_with(tmp_path, _tiny_tensors())
    runner = TorchModelRunner(
        EngineConfig(model=str(folder), max_model_len=1000, block_size=8), progress=False
    )
    assert runner.max_model_len == 64  # capped at the model's context
    # default CPU budget: four full-length sequences
    assert runner.num_kv_blocks == 4 * 64 // 8
    block_bytes = 2 * 1 * 8 * 2 * 8 * 4  # K+V, 1 layer, 8 tokens, 2 KV heads, head_dim 8, fp32
    budget = TorchModelRunner(
        EngineConfig(model=str(folder), block_size=8, kv_cache_memory=10 * block_bytes + 7), progress=False
    )
    assert budget.num_kv_blocks == 10
    with pytest.raises(RunnerConfigError, match="no block"):
        TorchModelRunner(EngineConfig(model=str(folder), kv_cache_memory=100), progress=False)
    with pytest.raises(RunnerConfigError, match="dtype"):
        pick_dtype("int8", torch.device("cpu"))


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_a_cuda_device_is_named_by_index(requested: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: only CUDA's presence is faked. The runner hands its device to
    # torch.cuda.set_device, which rejects plain "cuda" (found on an H200: every GPU runner
    # failed at start-up); the index is the current GPU's.
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = pick_device(requested)
    assert device == torch.device("cuda", 0)
    assert _get_device_index(device) == 0  # what torch.cuda.set_device does with it
    assert pick_device("cuda:0") == device
    assert pick_device("cpu") == torch.device("cpu")

"""Read a GGUF file: architecture metadata -> ModelConfig, tensors dequantized under HF names.

llama.cpp's converter permutes the rows of Q and K for the `llama` architecture (it rotates
interleaved pairs where Hugging Face rotates halves); we undo that so the weights, and therefore
the outputs, equal the Hugging Face model's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgate.engine.loader.checkpoint import Checkpoint
from kvgate.engine.loader.gguf_reader import GGUFFile
from kvgate.engine.models.config import ModelConfig, RopeScaling, UnsupportedModelError

_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_QK = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors with no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config_from_metadata(gguf: GGUFFile) -> ModelConfig:
    tensor_names = set(gguf.tensors)
    arch = str(gguf.metadata.get("general.architecture", ""))
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf.metadata.get(f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; the Llama family keeps them equal
        kv_heads = kv_heads[0]
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    scaling = RopeScaling()
    scaling_type = meta("rope.scaling.type", "none")
    factor = float(meta("rope.scaling.factor", 1.0) or 1.0)
    if scaling_type == "linear" and factor != 1.0:
        scaling = RopeScaling(kind="linear", factor=factor)
    elif scaling_type not in ("none", "linear", None):
        raise UnsupportedModelError(
            f"GGUF RoPE scaling {scaling_type!r} is not supported (supported: linear)"
        )
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=scaling,
        source_dtype="float32",
    )


def open_gguf(path: Path) -> Checkpoint:
    gguf = GGUFFile(path)
    config = _config_from_metadata(gguf)
    permuted = config.architecture in _PERMUTED_QK

    def load(name: str) -> np.ndarray:
        try:
            array = gguf.dequantize(name)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{path}: tensor {name} uses an unsupported type: {e}") from e
        # F32 tensors come back as read-only views of the memory-mapped file.
        return array if array.flags.writeable else array.copy()

    freq_factors = None
    if "rope_freqs.weight" in gguf.tensors:
        freq_factors = [float(x) for x in load("rope_freqs.weight")]
    mapped = [(n, hf) for n in gguf.tensors if (hf := hf_name(n)) is not None]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, hf in mapped:
            array = load(name)
            if permuted and ".attn_q." in name:
                array = unpermute_qk(array, config.num_heads)
            elif permuted and ".attn_k." in name:
                array = unpermute_qk(array, config.num_kv_heads)
            yield hf, torch.from_numpy(np.ascontiguousarray(array))

    return Checkpoint(config=config, num_tensors=len(mapped), tensors=tensors, rope_freq_factors=freq_factors)

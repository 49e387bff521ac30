"""The architecture description every loader produces and every model reads.

One dataclass for the Llama family: Llama 2/3, Mistral and SmolLM2 are plain Llama; Qwen2/2.5
add a bias on the q/k/v projections; Qwen3 adds a per-head RMSNorm on q and k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model is a family or variant this engine does not implement; the message says which."""


@dataclass
class RopeScaling:
    """RoPE frequency scaling. kind: none | linear | llama3 (Llama 3.1 long-context) | factors."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    source_dtype: str = "float32"  # dtype of the stored weights (bf16 checkpoints stay bf16 on GPU)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from_hf(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    """transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    scaling = config.get("rope_scaling")
    if not isinstance(params, dict):
        params = dict(scaling) if isinstance(scaling, dict) else {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    factor = float(params.get("factor", 1.0))
    if kind in ("default", "none") or (kind == "linear" and factor == 1.0):
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=factor)
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported (supported: linear, llama3)")


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = config.get("architectures") or []
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({', '.join(archs) or 'no architectures listed'}) is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        theta, scaling = _rope_from_hf(config)
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
            source_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )
    except KeyError as e:
        raise UnsupportedModelError(f"config.json lacks required key {e.args[0]!r}") from e

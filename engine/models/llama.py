"""The Llama family: Llama 2/3, Mistral, SmolLM2, Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k norm).

Differences between them are flags on ModelConfig; the module tree is one. Weights arrive under
Hugging Face names (the GGUF loader translates its own) and are routed into fused projections
by `load_weights`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.engine.layers.activation import silu_and_mul
from kvgate.engine.layers.attention import Attention, AttentionBackend, AttentionMetadata
from kvgate.engine.layers.embedding import LMHead, VocabEmbedding
from kvgate.engine.layers.linear import Linear, MergedLinear
from kvgate.engine.layers.norm import RMSNorm
from kvgate.engine.layers.rotary import RotaryEmbedding
from kvgate.engine.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model (missing, unexpected or mis-shaped tensors)."""


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            bias=cfg.qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, [size, size], bias=cfg.mlp_bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        # CPU: two GEMMs over the fused weight's halves (contiguous views) beat one over the
        # whole, whose weight overflows the cache, and need no split of the output.
        proj = self.gate_up_proj
        size = proj.output_sizes[0]
        gate = F.linear(x, proj.weight[:size], None if proj.bias is None else proj.bias[:size])
        up = F.linear(x, proj.weight[size:], None if proj.bias is None else proj.bias[size:])
        delta = proj.lora.delta(x) if proj.lora is not None else None
        if delta is not None:  # a step with LoRA adapters: the fused delta, split like the weight
            gate += delta[:, :size]
            up += delta[:, size:]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, rotary, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        rope_freq_factors: list[float] | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors, device=device
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary, backend, dtype, device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch; logits come from `compute_logits`."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        assert residual is not None
        hidden, _ = self.norm.forward_residual(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- weights -------------------------------------------------------------------------------

    _STACKED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; fail on anything missing or odd."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard_of = self._target(name)
            param = params.get(target)
            if param is None:
                raise WeightLoadError(f"checkpoint tensor {name!r} has no place in the model")
            dest = param.data
            if shard_of is not None:
                module = self.get_submodule(target.rsplit(".", 1)[0])
                assert isinstance(module, MergedLinear)
                dest = module.shard(param.data, shard_of)
                filled.add(f"{target}#{shard_of}")
            else:
                filled.add(target)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
        expected = self._expected_fills(params)
        missing = sorted(expected - filled)
        if missing:
            raise WeightLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _target(self, name: str) -> tuple[str, int | None]:
        """Our parameter name for a HF tensor name (and the fused shard it fills)."""
        match = self._LAYER_RE.match(name)
        if match:
            layer, block, proj, kind = match.groups()
            if proj in self._STACKED:
                fused, shard = self._STACKED[proj]
                return f"layers.{layer}.{block}.{fused}.{kind}", shard
            return f"layers.{layer}.{block}.{proj}.{kind}", None
        if name.startswith("model.layers."):
            return name[len("model.") :], None  # layer norms, q_norm / k_norm
        if name.startswith("model."):
            return name[len("model.") :], None  # embed_tokens, norm
        return name, None  # lm_head

    def _expected_fills(self, params: dict[str, nn.Parameter]) -> set[str]:
        expected: set[str] = set()
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_name, _, _ = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, MergedLinear):
                expected.update(f"{name}#{i}" for i in range(len(module.output_sizes)))
            else:
                expected.add(name)
        return expected

"""Rotary position embedding with the scalings the Llama family uses (linear, llama3, per-frequency
factors from GGUF's rope_freqs), in Hugging Face's rotate-half layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvgate.engine.models.config import RopeScaling


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling, freq_factors: list[float] | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    if freq_factors is not None:
        # llama.cpp stores Llama 3.1's scaling as per-frequency divisors instead of metadata.
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slow down by `factor`, short ones stay, the band between blends."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def apply_rotary_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D]; cos_sin [max_pos, D] = [cos | sin] (fp32)."""
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        freq_factors: list[float] | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated (in place on CUDA)."""
        if q.is_cuda:
            from kvgate.engine.kernels.rotary import apply_rotary

            apply_rotary(positions, q, k, self.cos_sin)
            return q, k
        return apply_rotary_torch(positions, q, k, self.cos_sin)

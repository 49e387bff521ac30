"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face semantics: normalise in fp32, round to the input dtype, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, dtype: torch.dtype | None = None, device: torch.device | None = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of x ([T, n], or [T, heads, n] for per-head q/k norms)."""
        if x.is_cuda:
            from kvgate.engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); on CUDA the sum overwrites `residual` in place."""
        if x.is_cuda:
            from kvgate.engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual), residual
        summed = x + residual
        return rms_norm_torch(summed, self.weight, self.eps), summed

"""The gated MLP activation: silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from kvgate.engine.kernels.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)

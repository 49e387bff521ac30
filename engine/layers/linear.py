"""Linear projections. Fused ones (q|k|v, gate|up) load each checkpoint tensor into its slice,
so one matmul replaces three (or two)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.engine.layers.lora import LoRAWeights


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Weights are always overwritten by the loader; skip the random init.
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        # Set by the LoRA manager when adapters are served; a step without adapters adds nothing.
        self.lora: LoRAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(out, x)
        return out


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__(in_features, sum(output_sizes), bias=bias, dtype=dtype, device=device)
        self.output_sizes = output_sizes
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The slice of `param` (weight or bias) that shard `index` fills."""
        return param.narrow(0, self.offsets[index], self.output_sizes[index])

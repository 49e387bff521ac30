"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_CPU_VOCAB_CHUNK = 1024


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 (sampling and logprobs need the precision)."""
        if hidden.is_cuda or self.weight.shape[0] <= _CPU_VOCAB_CHUNK:
            return F.linear(hidden, self.weight).float()
        # On CPU, slices of the vocabulary that stay in cache run ~25% faster than one big GEMM
        # over a weight far larger than L2 (measured on the 49k x 576 SmolLM2 head).
        chunks = [
            F.linear(hidden, self.weight[i : i + _CPU_VOCAB_CHUNK])
            for i in range(0, self.weight.shape[0], _CPU_VOCAB_CHUNK)
        ]
        return torch.cat(chunks, dim=-1).float()

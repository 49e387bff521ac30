"""What every checkpoint reader hands the model builder: the architecture and a tensor stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvgate.engine.models.config import ModelConfig


@dataclass
class Checkpoint:
    config: ModelConfig
    num_tensors: int
    # Yields (Hugging Face tensor name, tensor) lazily, one at a time, so peak memory stays ~one tensor.
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    rope_freq_factors: list[float] | None = None  # GGUF's rope_freqs tensor (Llama 3.1 scaling)

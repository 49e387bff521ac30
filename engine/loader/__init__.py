"""Load a Llama-family model from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from kvgate.engine.layers.attention import AttentionBackend
from kvgate.engine.loader.checkpoint import Checkpoint
from kvgate.engine.models.llama import LlamaForCausalLM

__all__ = ["Checkpoint", "load_model", "open_checkpoint"]


def open_checkpoint(path: Path) -> Checkpoint:
    """Read the architecture of `path` (a HF folder or a .gguf file) without loading weights."""
    if path.is_file():
        from kvgate.engine.loader.gguf_file import open_gguf

        return open_gguf(path)
    from kvgate.engine.loader.hf import open_hf_folder

    return open_hf_folder(path)


def load_model(
    checkpoint: Checkpoint,
    backend: AttentionBackend,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
) -> LlamaForCausalLM:
    """Build the model on `device` and stream the checkpoint's tensors into it."""
    from tqdm import tqdm

    model = LlamaForCausalLM(
        checkpoint.config,
        backend,
        max_positions,
        dtype,
        device,
        rope_freq_factors=checkpoint.rope_freq_factors,
    )

    def with_progress() -> Iterator[tuple[str, torch.Tensor]]:
        bar = tqdm(total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", disable=not progress)
        with bar:
            for item in checkpoint.tensors():
                yield item
                bar.update(1)

    with torch.inference_mode():
        model.load_weights(with_progress())
    return model.eval()

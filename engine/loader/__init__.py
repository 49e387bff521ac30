"""Load a Llama-family model from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvgate.engine.layers.attention import AttentionBackend
from kvgate.engine.loader.checkpoint import Checkpoint
from kvgate.engine.models.llama import LlamaForCausalLM

log = logging.getLogger("kvgate.engine")

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
    """Build the model on `device` and stream the checkpoint's tensors into it.

    `progress`: a bar while loading when stderr is a terminal; otherwise (a log file, `kvgate up`
    reading its children line by line) one line when done, since a bar's carriage-return
    updates arrive there as one endless line."""
    from tqdm import tqdm

    model = LlamaForCausalLM(
        checkpoint.config,
        backend,
        max_positions,
        dtype,
        device,
        rope_freq_factors=checkpoint.rope_freq_factors,
    )

    bar_shown = progress and sys.stderr.isatty()

    def with_progress() -> Iterator[tuple[str, torch.Tensor]]:
        bar = tqdm(total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", disable=not bar_shown)
        with bar:
            for item in checkpoint.tensors():
                yield item
                bar.update(1)

    start = time.monotonic()
    with torch.inference_mode():
        model.load_weights(with_progress())
    if progress and not bar_shown:
        log.info("loaded %d weight tensors in %.1fs", checkpoint.num_tensors, time.monotonic() - start)
    return model.eval()

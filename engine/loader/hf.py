"""Read a Hugging Face model folder: config.json and safetensors shards (with or without an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from kvgate.engine.loader.checkpoint import Checkpoint
from kvgate.engine.models.config import UnsupportedModelError, model_config_from_hf


def open_hf_folder(folder: Path) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UnsupportedModelError(f"{folder} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as e:
        raise UnsupportedModelError(f"cannot parse {config_path}: {e}") from e
    config = model_config_from_hf(raw)
    files = _shard_files(folder)
    from safetensors import safe_open

    names: list[tuple[Path, str]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend((f, key) for key in handle.keys())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        current: Path | None = None
        handle = None
        for f, key in names:
            if f != current:
                handle = safe_open(str(f), framework="pt")
                current = f
            assert handle is not None
            yield key, handle.get_tensor(key)

    return Checkpoint(config=config, num_tensors=len(names), tensors=tensors)


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = list(folder.glob("*.bin")) + list(folder.glob("*.pt"))
        hint = " (only PyTorch .bin files: convert them to safetensors)" if bins else ""
        raise UnsupportedModelError(f"{folder} has no .safetensors weights{hint}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UnsupportedModelError(f"{folder}: the index lists missing shards, e.g. {missing[0].name}")
    return files

"""PEFT LoRA adapter folders: adapter_config.json + adapter_model.safetensors.

Read into CPU fp32 tensors per (layer, projection), checked against the base model's shapes,
so everything wrong with an adapter surfaces here as one `LoRAAdapterError` sentence (the
CLI prints it, the load endpoint returns it as a 400), never later inside a step.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgate.engine.models.config import ModelConfig

# The projections an adapter may target (Hugging Face names) and the block they live in.
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this model; the message says why."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # (layer, HF projection name) -> (A [rank, in], B [out, rank]), CPU fp32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a Hugging Face projection of this model."""
    return {
        "q_proj": (cfg.hidden_size, cfg.q_size),
        "k_proj": (cfg.hidden_size, cfg.kv_size),
        "v_proj": (cfg.hidden_size, cfg.kv_size),
        "o_proj": (cfg.q_size, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }[proj]


def load_peft_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    def fail(message: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r} ({path}): {message}")

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise fail("not a folder (expected a PEFT adapter folder with adapter_config.json)")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise fail("adapter_config.json is missing")
    try:
        conf = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(conf, dict):
        raise fail("adapter_config.json is not a JSON object")
    rank, alpha, use_rslora = conf.get("r"), conf.get("lora_alpha", 8), conf.get("use_rslora", False)
    if conf.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {conf.get('peft_type')!r} is not LORA")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise fail("per-module rank_pattern / alpha_pattern are not supported")
    if conf.get("use_dora"):
        raise fail("DoRA adapters (use_dora) are not supported")
    if conf.get("bias", "none") != "none":
        raise fail(f"bias={conf.get('bias')!r} is not supported (only 'none')")
    if conf.get("modules_to_save"):
        raise fail(f"modules_to_save {conf['modules_to_save']} is not supported")
    targets = _targets(conf.get("target_modules"), fail)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank

    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise fail(
                "adapter_model.bin (a pickle) is not loaded; save the adapter as safetensors "
                "(save_pretrained(..., safe_serialization=True))"
            )
        raise fail("adapter_model.safetensors is missing")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise fail(f"cannot read adapter_model.safetensors: {exc}") from None

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise fail(f"unexpected tensor {key!r} (only q/k/v/o/gate/up/down_proj lora_A/lora_B are served)")
        layer, block, proj, kind = int(match[1]), match[2], match[3], match[4]
        if TARGET_MODULES.get(proj) != block:
            raise fail(f"unknown target module {proj!r} in {key!r}")
        if proj not in targets:
            raise fail(f"tensor {key!r} is for {proj!r}, which target_modules does not list")
        if layer >= cfg.num_layers:
            raise fail(f"tensor {key!r} is for layer {layer}; the base model has {cfg.num_layers} layers")
        pairs.setdefault((layer, proj), {})[kind] = tensor
    if not pairs:
        raise fail("adapter_model.safetensors holds no LoRA weights")

    adapter = LoRAAdapter(name, str(folder), rank, float(scaling))
    for (layer, proj), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise fail(f"layer {layer} {proj} has lora_{next(iter(pair))} but not its pair")
        a, b = pair["A"], pair["B"]
        in_features, out_features = projection_shape(cfg, proj)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise fail(
                f"layer {layer} {proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have rank {rank}"
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise fail(
                f"layer {layer} {proj} maps {a.shape[1]} -> {b.shape[0]} features, the base model's "
                f"maps {in_features} -> {out_features} (hidden size {cfg.hidden_size}): the adapter "
                "was trained for another base model"
            )
        adapter.weights[(layer, proj)] = (a.float().contiguous(), b.float().contiguous())
    return adapter


def _targets(value: object, fail: Callable[[str], LoRAAdapterError]) -> set[str]:
    if value == "all-linear":
        return set(TARGET_MODULES)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise fail(f"target_modules must be a non-empty list of module names, got {value!r}")
    unknown = sorted(set(names) - set(TARGET_MODULES))
    if unknown:
        raise fail(f"unknown target modules {unknown} (supported: {', '.join(TARGET_MODULES)})")
    return set(names)

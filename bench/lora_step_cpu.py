"""Decode step time with LoRA on the default model, CPU fp32, one thread, one process.

Three batches of the same size and prompts, measured in turns (so machine noise hits all):
  off    the engine without --enable-lora
  base   --enable-lora, every request on the base model (must cost what `off` costs)
  mixed  --enable-lora, two adapters (rank 8 on q/v/down, rank 16 on all seven) plus base requests

    .venv/bin/python -P bench/lora_step_cpu.py [--seqs 8] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvgate.api.lora import lora_int_id
from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.loader.peft import TARGET_MODULES, projection_shape
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.sampling_params import SamplingParams


def write_adapter(folder: Path, cfg: object, rank: int, targets: list[str], seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    tensors = {}
    for layer in range(cfg.num_layers):  # type: ignore[attr-defined]
        for proj in targets:
            d_in, d_out = projection_shape(cfg, proj)  # type: ignore[arg-type]
            key = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def decode_step_ms(
    runner: TorchModelRunner, lora: bool, ids: list[int | None], steps: int, adapters: dict[str, Path]
) -> float:
    config = EngineConfig(device="cpu", num_kv_blocks=128, enable_lora=lora, max_loras=2)
    engine = LLMEngine(config, runner=runner, tokenizer=runner.tokenizer)
    for name, path in adapters.items() if lora else ():
        engine.add_lora(name, engine.load_lora(name, str(path)))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    prompt = runner.tokenizer.encode("Write a short story about a lighthouse keeper and the sea.")
    for i, lora_id in enumerate(ids):
        engine.add_request(f"r{i}", [*prompt, i], params, lora_id=lora_id)
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    off = TorchModelRunner(EngineConfig(device="cpu", num_kv_blocks=128), progress=False)
    on = TorchModelRunner(
        EngineConfig(device="cpu", num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16),
        progress=False,
    )
    cfg = on.model_config
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            "r8": write_adapter(Path(tmp) / "r8", cfg, 8, ["q_proj", "v_proj", "down_proj"], 1),
            "r16": write_adapter(Path(tmp) / "r16", cfg, 16, list(TARGET_MODULES), 2),
        }
        n = args.seqs
        mixed: list[int | None] = [None] * (n - 2 * (n // 4)) + [lora_int_id("r8")] * (n // 4)
        mixed += [lora_int_id("r16")] * (n // 4)
        results: dict[str, list[float]] = {"off": [], "base": [], "mixed": []}
        for _ in range(args.rounds):
            results["off"].append(decode_step_ms(off, False, [None] * n, args.steps, adapters))
            results["base"].append(decode_step_ms(on, True, [None] * n, args.steps, adapters))
            results["mixed"].append(decode_step_ms(on, True, mixed, args.steps, adapters))
    print(
        f"decode step, {n} seqs, CPU fp32, 1 thread, median of {args.steps} steps, best of {args.rounds} rounds:"
    )
    for label, values in results.items():
        print(f"  {label:5s} {min(values):7.1f} ms   (rounds: {', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()

"""Decode throughput and HBM bandwidth of kvgate's GPU path (Triton kernels + CUDA graphs).

Random bf16 weights in a real model shape (Llama 3.2 1B / 3B, Llama 3.1 8B): decode speed does
not depend on the weights' values. For each batch size, every sequence starts with --context
tokens already in the paged KV cache (content irrelevant to speed) and the runner executes
--steps decode steps through `TorchModelRunner.execute` (input building, graph replay, LM head,
sampling: everything but the scheduler).

Bandwidth: bytes a decode step must read from HBM (all weights once, including the LM head,
plus every sequence's K and V) / step time, as a fraction of the GPU's peak (--peak-tbps, or
looked up from the device name). Target: >= 60% at batch 64.

Usage: python bench/engine_gpu.py [--shape 8b] [--batches 1,16,64,256] [--context 512]
                                  [--steps 32] [--eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.core.runner_api import ScheduledBatch, ScheduledSeq
from kvgate.engine.loader import Checkpoint
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.models.config import ModelConfig, RopeScaling
from kvgate.engine.sampling_params import SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(
        hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, tie=True
    ),
    "3b": dict(
        hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8, tie=True
    ),
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, tie=False
    ),
}
PEAK_TBPS = {
    "H200": 4.8,
    "H100 SXM": 3.35,
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "H100": 3.35,
    "A100": 2.0,
    "L40S": 0.864,
}


def model_config(shape: str) -> ModelConfig:
    s = SHAPES[shape]
    return ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_layers=s["num_layers"],
        num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"],
        head_dim=s["hidden_size"] // s["num_heads"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=s["tie"],
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        source_dtype="bfloat16",
    )


def random_checkpoint(cfg: ModelConfig, device: torch.device) -> Checkpoint:
    """HF-named random tensors, made on the GPU (CPU randn of 8B weights takes minutes)."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (cfg.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (cfg.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, cfg.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, cfg.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, cfg.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (cfg.hidden_size, cfg.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, cfg.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, cfg.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (cfg.hidden_size, cfg.intermediate_size)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, device=device, dtype=torch.bfloat16)
            else:
                yield name, torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02

    return Checkpoint(config=cfg, num_tensors=len(shapes), tensors=tensors)


def weight_bytes(runner: TorchModelRunner) -> int:
    seen: set[int] = set()
    total = 0
    for p in runner.model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    cfg = runner.model_config
    # The embedding lookup reads B rows, not the table; a tied table is read once, by the LM head.
    if not cfg.tie_word_embeddings:
        total -= cfg.vocab_size * cfg.hidden_size * runner.model.embed_tokens.weight.element_size()
    return total


def peak_tbps(name: str, override: float | None) -> float:
    if override:
        return override
    for key, value in PEAK_TBPS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tbps")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (random weights)")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens already cached per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--peak-tbps", type=float, default=None, help="HBM peak, TB/s (default: by GPU name)")
    parser.add_argument("--json", default=None, help="also write results to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this benchmark needs one")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    cfg = model_config(args.shape)
    block_size = 16
    blocks_per_seq = math.ceil((args.context + args.steps + 2) / block_size)
    engine_cfg = EngineConfig(
        model=f"random-{args.shape}",
        device="cuda",
        dtype="bfloat16",
        block_size=block_size,
        max_model_len=4096,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches)),
        num_kv_blocks=max(batches) * blocks_per_seq + 1,
        enforce_eager=args.eager,
    )
    start = time.perf_counter()
    runner = TorchModelRunner(engine_cfg, checkpoint=random_checkpoint(cfg, device))
    print(
        f"set-up {time.perf_counter() - start:.1f} s (weights, KV pool, CUDA graphs: {runner.graphs is not None})"
    )
    gpu = torch.cuda.get_device_name(device)
    peak = peak_tbps(gpu, args.peak_tbps) * 1e12
    w_bytes = weight_bytes(runner)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    print(
        f"{gpu}: peak {peak / 1e12:.2f} TB/s; {args.shape} shape, weights {w_bytes / 2**30:.2f} GiB, "
        f"context {args.context}, {args.steps} steps"
    )
    print(f"{'batch':>6} {'step ms':>9} {'tok/s':>10} {'GB/step':>9} {'TB/s':>7} {'of peak':>8}")
    params = SamplingParams(temperature=0.0, max_tokens=None)
    rows = []
    for b in batches:
        tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(b)]

        def step(pos: int, tables: list[list[int]] = tables, b: int = b) -> None:
            seqs = [
                ScheduledSeq(f"s{i}", [i % 1000 + 1], pos, tables[i], True, params, pos) for i in range(b)
            ]
            runner.execute(ScheduledBatch(seqs))

        for w in range(3):  # warm-up
            step(args.context + w)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for s in range(args.steps):
            step(args.context + s)
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - start) / args.steps
        mean_ctx = args.context + args.steps / 2
        bytes_step = w_bytes + b * mean_ctx * kv_per_token
        bw = bytes_step / step_s
        rows.append(
            {
                "batch": b,
                "step_ms": step_s * 1e3,
                "tok_per_s": b / step_s,
                "bytes_per_step": bytes_step,
                "tbps": bw / 1e12,
                "fraction_of_peak": bw / peak,
            }
        )
        print(
            f"{b:>6} {step_s * 1e3:>9.2f} {b / step_s:>10.0f} {bytes_step / 1e9:>9.2f} {bw / 1e12:>7.2f} {bw / peak:>7.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": gpu, "shape": args.shape, "context": args.context, "eager": args.eager, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""GPU cost of the batched mixed-adapter LoRA kernels (engine/kernels/lora.py), per projection.

For each batch size T, every token gets a random adapter slot (a share of them -1, the base
model) and the script times, with CUDA events over --iters calls after a warm-up:
- base:   the projection itself, x @ W.T (what the LoRA delta rides on);
- triton: lora_delta_triton(..., out=y), the delta added into the base output in place;
- torch:  the grouped torch path (two GEMMs per distinct adapter in the batch, index_copy).
and checks the Triton result against an fp64 reference once per shape (max abs error).

Needs a CUDA GPU (exits 2 without one). Not run in CI; the kernels' correctness tests are
tests/engine/test_lora_kernel.py (interpreter, CPU).

Usage: python -P bench/lora_kernel.py [--batches 1,8,64,256,2048] [--in 4096] [--out 4096]
           [--rank 16] [--slots 8] [--base-share 0.25] [--dtype bf16] [--iters 50] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def grouped_torch(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        out.index_copy_(
            0, rows, (x.index_select(0, rows) @ lora_a[slot].t()) @ lora_b[slot].t() * scaling[slot]
        )
    return out


def reference(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    a = lora_a.double()[slots.clamp(min=0)]  # [T, r, in]
    b = lora_b.double()[slots.clamp(min=0)]  # [T, out, r]
    h = torch.einsum("ti,tri->tr", x.double(), a) * scaling.double()[slots.clamp(min=0)][:, None]
    delta = torch.einsum("tr,tor->to", h, b)
    return delta * (slots >= 0)[:, None]


def time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(
    tokens: int,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    base_share: float,
    iters: int,
) -> dict[str, float]:
    from kvgate.engine.kernels.lora import lora_delta_triton

    dev, slot_count = weight.device, lora_a.shape[0]
    x = torch.randn(tokens, weight.shape[1], device=dev, dtype=weight.dtype)
    slots = torch.randint(0, slot_count, (tokens,), device=dev)
    slots[torch.rand(tokens, device=dev) < base_share] = -1
    y = x @ weight.t()
    expected = y.double() + reference(x, slots, lora_a, lora_b, scaling)
    got = lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y.clone())
    err = (got.double() - expected).abs().max().item() if tokens else 0.0
    base = time_ms(lambda: x @ weight.t(), iters)
    tri = time_ms(lambda: lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y), iters)
    tor = time_ms(lambda: y.add_(grouped_torch(x, slots, lora_a, lora_b, scaling)), iters)
    return dict(tokens=tokens, base_ms=base, triton_ms=tri, torch_ms=tor, max_abs_err=err)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64,256,2048")
    parser.add_argument("--in", dest="in_features", type=int, default=4096)
    parser.add_argument("--out", dest="out_features", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16, help="r_max of the slot buffers")
    parser.add_argument("--slots", type=int, default=8, help="adapter slots (--max-loras)")
    parser.add_argument("--base-share", type=float, default=0.25, help="share of tokens with slot -1")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write results to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_kernel bench needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), DTYPES[args.dtype]
    n_in, n_out, r, s = args.in_features, args.out_features, args.rank, args.slots
    weight = torch.randn(n_out, n_in, device=dev, dtype=dtype) / n_in**0.5
    lora_a = (torch.randn(s, r, n_in, device=dev) / n_in**0.5).to(dtype)
    lora_b = torch.randn(s, n_out, r, device=dev).to(dtype)
    scaling = torch.full((s,), 2.0, device=dev)
    print(f"{torch.cuda.get_device_name()}  in={n_in} out={n_out} r_max={r} slots={s} {args.dtype}")
    print(f"{'T':>6} {'base ms':>9} {'triton ms':>10} {'torch ms':>9} {'max err':>9}")
    rows = []
    for tokens in (int(b) for b in args.batches.split(",")):
        row = measure(tokens, weight, lora_a, lora_b, scaling, args.base_share, args.iters)
        print(
            f"{tokens:>6} {row['base_ms']:>9.4f} {row['triton_ms']:>10.4f} {row['torch_ms']:>9.4f} {row['max_abs_err']:>9.2e}"
        )
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

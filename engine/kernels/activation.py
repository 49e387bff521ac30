"""SiLU-and-mul: out = silu(x[:, :d]) * x[:, d:], the gated MLP's activation, in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, d, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the storage dtype before the product, as the unfused module does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2d] (last dim contiguous) -> [T, d]."""
    tokens, two_d = x.shape
    d = two_d // 2
    out = torch.empty((tokens, d), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(tokens, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block)
    return out

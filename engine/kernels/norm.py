"""RMSNorm with an optional fused residual add, as one Triton kernel.

`x` is viewed as [tokens, rows_per_token, n] (rows_per_token > 1 normalises each head of a
q/k projection, Qwen3's q_norm/k_norm, straight from the strided qkv view). With a residual the
kernel computes s = x + residual, writes s back into `residual` (rounded to its dtype, as the
unfused model would store it) and returns norm(s) — one pass over memory instead of three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_xt,
    stride_xr,
    stride_rt,
    stride_ot,
    stride_or,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + t * stride_xt + r * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + t * stride_rt + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + t * stride_ot + r * stride_or + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x [+ residual]) over the last dim. x: [T, n] or [T, R, n] (last dim contiguous).

    With `residual` ([T, n], contiguous), it is updated in place to x + residual.
    """
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs a contiguous last dimension")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    tokens, rows, n = x3.shape
    out = torch.empty((tokens, rows, n), dtype=x.dtype, device=x.device)
    if residual is not None:
        if rows != 1 or not residual.is_contiguous() or residual.shape != x.shape:
            raise ValueError("a fused residual needs x and residual of the same [T, n] shape")
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(tokens, rows)](
        x3,
        residual if residual is not None else x3,
        weight,
        out,
        x3.stride(0),
        x3.stride(1),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        out.stride(1),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 1,
    )
    return out.view(x.shape)

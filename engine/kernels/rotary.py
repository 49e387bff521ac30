"""Rotary position embedding (NeoX / Hugging Face "rotate_half" layout), in place on q and k.

One program per token rotates every q head and every k head of that token, reading cos and sin
from a [max_positions, head_dim] cache laid out as [cos(half) | sin(half)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base_ptr, stride_h, n_heads, cos, sin, d, dmask, HALF: tl.constexpr, HEADS_PAD: tl.constexpr
):
    h = tl.arange(0, HEADS_PAD)
    mask = (h[:, None] < n_heads) & dmask[None, :]
    ptr = base_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out_dtype = base_ptr.dtype.element_ty
    tl.store(ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, cos, sin, d, dmask, HALF, Q_HEADS_PAD)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, n_k_heads, cos, sin, d, dmask, HALF, K_HEADS_PAD)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (strided views into a fused qkv are fine)."""
    tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("apply_rotary needs a contiguous head dimension")
    if tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        n_q,
        n_k,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(n_q),
        K_HEADS_PAD=triton.next_power_of_2(n_k),
        num_warps=4,
    )

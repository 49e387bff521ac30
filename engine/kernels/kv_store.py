"""Write the new tokens' K and V into the paged cache, one program per token.

Caches are [num_blocks, block_size, kv_heads, head_dim]; a token's slot is
block_id * block_size + offset (the slot mapping the runner builds). A negative slot marks a
padding token (CUDA-graph batches are padded) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    slots = tl.zeros([BLOCK], dtype=tl.int64) + slot  # as a block: a scalar mask term trips the interpreter
    mask = (offs < ROW) & (slots >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim] with each token's heads contiguous; caches contiguous."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    row = kv_heads * head_dim
    if k.stride(1) != head_dim or v.stride(1) != head_dim or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv needs each token's K/V heads contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous caches")
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )

"""Batched mixed-adapter LoRA (BGMV style): each token gathers the weights of its own adapter slot.

    delta[t] = scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T    with s = slots[t]

Adapters live stacked in slot buffers, `lora_a` [S, r_max, in] and `lora_b` [S, out, r_max];
an adapter of rank r < r_max fills the first r rows of A and columns of B and leaves the rest zero,
so padding adds nothing. A token with slot -1 (a base-model request) gets no delta.

Two kernels, as in vLLM's punica path:
- shrink: h[t] = scaling[s] * x[t] @ A[s].T, one program per token ([T, r_max], fp32);
- expand: y[t, n-tile] (+)= h[t] @ B[s, n-tile].T, one program per (token, output tile).
Both reduce in fp32 and skip slot -1 programs entirely (no weight reads).

Each token's sum runs in a fixed order over its own row only (no split-K, no atomics), so a
token's delta does not depend on how many other tokens or which adapters share the batch: the
"mixed batch equals each request alone" property holds bit for bit, which split-K would break.
The price is T programs for the shrink, which is few in decode; unmeasured on a GPU.

Dispatch (for `kvgate.engine.layers.lora`): call `lora_delta_triton` only for CUDA tensors and
keep the torch path on CPU, as the other layers do, importing this module lazily so the CPU path
never imports triton:

    if x.is_cuda:
        from kvgate.engine.kernels.lora import lora_delta_triton
        lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y)   # y += delta, in place
    else:
        y += lora_delta_torch(...)

`out=` may be a column slice of a fused projection's output (e.g. the q part of qkv): only its
last dimension must be contiguous.

No host syncs (slots are not range-checked on the host, grids depend only on shapes), so the
calls can be captured in the decode CUDA graphs, provided slots/scaling/weights live in
persistent buffers updated in place between replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes: the reduction chunk over `in` and the output tile, clipped to the problem (next
# power of two) so small test shapes stay small under the interpreter, and shrunk as the rank
# grows so a [BLOCK_R, BLOCK_K] / [BLOCK_N, BLOCK_R] weight tile stays at most _TILE elements
# (a fused q|k|v stacks three ranks side by side: r_max 192 for rank 64).
_BLOCK_K = 128
_BLOCK_N = 128
_TILE = 8192
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    slots_ptr,
    a_ptr,
    scaling_ptr,
    h_ptr,
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + ranks[:, None] * stride_ar
        for k0 in range(0, in_features, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            x = tl.load(x_ptr + t * stride_xt + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        acc = acc * tl.load(scaling_ptr + slot).to(tl.float32)
    # Always written (zeros for slot -1) so the expand never reads uninitialised memory.
    tl.store(h_ptr + t * stride_ht + ranks, acc, mask=rank_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    slots_ptr,
    b_ptr,
    y_ptr,
    out_features,
    rank,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    ADD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    slot = tl.load(slots_ptr + t)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    y_ptrs = y_ptr + t * stride_yt + cols
    if slot >= 0:
        h = tl.load(h_ptr + t * stride_ht + ranks, mask=rank_mask, other=0.0)
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
            mask=col_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
        if ADD:
            delta += tl.load(y_ptrs, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=col_mask)
    elif not ADD:
        tl.store(y_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32).to(y_ptr.dtype.element_ty), mask=col_mask)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def _check_slots(slots: torch.Tensor, tokens: int, device: torch.device) -> None:
    if slots.dim() != 1 or slots.shape[0] != tokens:
        raise ValueError(f"slots must be [T] = [{tokens}], got {list(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    if slots.device != device:
        raise ValueError("slots must be on the same device as x")


def lora_shrink(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """h[t] = scaling[s] * x[t] @ lora_a[s].T with s = slots[t]; zero rows for s = -1.

    x: [T, in]; slots: [T] int (-1 = none, otherwise < S: not checked, a host sync per call would
    cost more than the kernel); lora_a: [S, r_max, in]; scaling: [S]. Returns [T, r_max] fp32
    (the expand reads it in fp32, so the rank-r intermediate is not rounded).
    """
    if x.dim() != 2 or lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(
            f"x [T, in] and lora_a [S, r_max, in] disagree: {list(x.shape)}, {list(lora_a.shape)}"
        )
    if x.dtype not in _FLOAT_DTYPES or lora_a.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtypes {x.dtype}, {lora_a.dtype}")
    if scaling.shape != (lora_a.shape[0],):
        raise ValueError(f"scaling must be [S] = [{lora_a.shape[0]}], got {list(scaling.shape)}")
    _check_slots(slots, x.shape[0], x.device)
    _check_rows("x", x)
    _check_rows("lora_a", lora_a)
    tokens, in_features = x.shape
    rank = lora_a.shape[1]
    h = torch.empty((tokens, rank), dtype=torch.float32, device=x.device)
    if tokens == 0 or rank == 0:
        return h.zero_()
    block_r = triton.next_power_of_2(rank)
    block_k = min(_BLOCK_K, max(16, _TILE // block_r), triton.next_power_of_2(in_features))
    _lora_shrink_kernel[(tokens,)](
        x,
        slots,
        lora_a,
        scaling,
        h,
        in_features,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        h.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return h


def lora_expand(
    h: torch.Tensor,
    slots: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor | None = None,
    add: bool = True,
) -> torch.Tensor:
    """y[t] = h[t] @ lora_b[s].T with s = slots[t] (zero, or y untouched, for s = -1).

    h: [T, r_max] (fp32 from `lora_shrink`); lora_b: [S, out, r_max]. With `out` ([T, out], last
    dim contiguous, any float dtype) the result goes there: added to it when `add` (y += delta;
    rows with s = -1 are left alone), overwritten otherwise. Without `out` a new tensor in
    lora_b's dtype is returned (`add` does not apply).
    """
    if h.dim() != 2 or lora_b.dim() != 3 or lora_b.shape[2] != h.shape[1]:
        raise ValueError(
            f"h [T, r_max] and lora_b [S, out, r_max] disagree: {list(h.shape)}, {list(lora_b.shape)}"
        )
    if lora_b.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {lora_b.dtype}")
    _check_slots(slots, h.shape[0], h.device)
    _check_rows("h", h)
    _check_rows("lora_b", lora_b)
    tokens, rank = h.shape
    out_features = lora_b.shape[1]
    if out is None:
        out = torch.empty((tokens, out_features), dtype=lora_b.dtype, device=h.device)
        add = False
    elif out.shape != (tokens, out_features) or out.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out must be a float [T, out] = [{tokens}, {out_features}], got {list(out.shape)}")
    _check_rows("out", out)
    if tokens == 0 or out_features == 0:
        return out
    if rank == 0:
        return out if add else out.zero_()
    block_r = triton.next_power_of_2(rank)
    block_n = min(_BLOCK_N, max(16, _TILE // block_r), triton.next_power_of_2(out_features))
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        h,
        slots,
        lora_b,
        out,
        out_features,
        rank,
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        ADD=add,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return out


def lora_delta_triton(
    x: torch.Tensor,
    slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LoRA delta of every token under its own adapter: [T, out] in x's dtype.

    With `out` ([T, out], e.g. the base projection's output or a column slice of it) the delta is
    added into it in place (fp32 sum, one rounding) and `out` is returned: no [T, out] buffer.
    """
    if lora_b.dim() != 3 or lora_a.dim() != 3 or lora_b.shape[0] != lora_a.shape[0]:
        raise ValueError(f"lora_a {list(lora_a.shape)} and lora_b {list(lora_b.shape)} disagree on slots")
    h = lora_shrink(x, slots, lora_a, scaling)
    if out is None:
        out = torch.empty((x.shape[0], lora_b.shape[1]), dtype=x.dtype, device=x.device)
        return lora_expand(h, slots, lora_b, out=out, add=False)
    return lora_expand(h, slots, lora_b, out=out, add=True)

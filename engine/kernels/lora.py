"""Batched mixed-adapter LoRA (BGMV style): each token gathers the weights of its own adapter slot.

    delta[t] = scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T    with s = slots[t]

Adapters live stacked in slot buffers, `lora_a` [S, r_max, in] and `lora_b` [S, out, r_max];
an adapter of rank r < r_max fills the first r rows of A and columns of B and leaves the rest zero,
so padding adds nothing. A token with slot -1 (a base-model request) gets no delta.

Two kernels, as in vLLM's punica path:
- shrink: h[t] = scaling[s] * x[t] @ A[s].T, per (token, chunk of `in`), fp32 partials;
- expand: y[t, n-tile] (+)= h[t] @ B[s, n-tile].T, per (token, output tile).
Both reduce in fp32 and skip slot -1 programs entirely (no weight reads).

The shrink is split over `in` (split-K) so that a decode step of a few tokens still runs many
programs; the partials go to a [T, splits, r_max] buffer that the expand sums in a fixed order,
not through atomics. The split depends on `in` only, never on T or the batch's contents, so a
token's delta is bit for bit the same whatever else shares the batch (and run to run).
Performance on a GPU is unmeasured (bench/lora_kernel.py measures it).

Dispatch (`kvgate.engine.layers.lora.add_lora_delta` does this): call `lora_delta_triton` only
for CUDA tensors and keep the torch path on CPU, as the other layers do, importing this module
lazily so the CPU path never imports triton:

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
# Split-K of the shrink: each token's `in` is cut into chunks of about _SPLIT_COLS columns, one
# program each (at most _MAX_SPLITS), so a decode batch of a few tokens still spreads over the
# GPU; the expand sums the chunks' partials. 4096 columns: 16 programs per token, 14336: 28.
_SPLIT_COLS = 256
_MAX_SPLITS = 32
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
    cols_per_split,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    stride_hs,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (t, k): token t's partial sum over its k-th chunk of `in` columns.
    t = tl.program_id(0)
    k = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + ranks[:, None] * stride_ar
        k_start = k * cols_per_split
        k_end = tl.minimum(k_start + cols_per_split, in_features)
        for k0 in range(k_start, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < k_end
            x = tl.load(x_ptr + t * stride_xt + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        acc = acc * tl.load(scaling_ptr + slot).to(tl.float32)
    # Always written (zeros for slot -1) so the expand never reads uninitialised memory.
    tl.store(h_ptr + t * stride_ht + k * stride_hs + ranks, acc, mask=rank_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    slots_ptr,
    b_ptr,
    y_ptr,
    out_features,
    rank,
    splits,
    stride_ht,
    stride_hs,
    stride_bs,
    stride_bn,
    stride_yt,
    ADD: tl.constexpr,
    BLOCK_S: tl.constexpr,
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
        # The shrink's split-K partials, summed here in a fixed order (no atomics).
        parts = tl.arange(0, BLOCK_S)
        partials = tl.load(
            h_ptr + t * stride_ht + parts[:, None] * stride_hs + ranks[None, :],
            mask=(parts[:, None] < splits) & rank_mask[None, :],
            other=0.0,
        )
        h = tl.sum(partials, axis=0)
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


def _split_columns(in_features: int, block_k: int) -> int:
    """Columns of `in` per shrink program: about _SPLIT_COLS, at most _MAX_SPLITS programs per
    token, a multiple of BLOCK_K. Depends on `in` only, never on T (see the module docstring)."""
    cols = max(_SPLIT_COLS, triton.cdiv(in_features, _MAX_SPLITS))
    return triton.cdiv(cols, block_k) * block_k


def lora_shrink_partials(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """The shrink as split-K partials: [T, splits, r_max] fp32 whose sum over dim 1 is
    `lora_shrink`'s h. `lora_expand` takes them as they are and sums them itself."""
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
    block_r = triton.next_power_of_2(max(rank, 1))
    block_k = min(_BLOCK_K, max(16, _TILE // block_r), triton.next_power_of_2(max(in_features, 1)))
    cols_per_split = _split_columns(in_features, block_k)
    splits = max(1, triton.cdiv(in_features, cols_per_split))
    h = torch.empty((tokens, splits, rank), dtype=torch.float32, device=x.device)
    if tokens == 0 or rank == 0 or in_features == 0:
        return h.zero_()
    _lora_shrink_kernel[(tokens, splits)](
        x,
        slots,
        lora_a,
        scaling,
        h,
        in_features,
        rank,
        cols_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        h.stride(0),
        h.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return h


def lora_shrink(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """h[t] = scaling[s] * x[t] @ lora_a[s].T with s = slots[t]; zero rows for s = -1.

    x: [T, in]; slots: [T] int (-1 = none, otherwise < S: not checked, a host sync per call would
    cost more than the kernel); lora_a: [S, r_max, in]; scaling: [S]. Returns [T, r_max] fp32
    (the expand reads it in fp32, so the rank-r intermediate is not rounded).
    """
    return lora_shrink_partials(x, slots, lora_a, scaling).sum(dim=1)


def lora_expand(
    h: torch.Tensor,
    slots: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor | None = None,
    add: bool = True,
) -> torch.Tensor:
    """y[t] = h[t] @ lora_b[s].T with s = slots[t] (zero, or y untouched, for s = -1).

    h: [T, r_max] (from `lora_shrink`) or [T, splits, r_max] partials (from
    `lora_shrink_partials`, summed here); lora_b: [S, out, r_max]. With `out` ([T, out], last
    dim contiguous, any float dtype) the result goes there: added to it when `add` (y += delta;
    rows with s = -1 are left alone), overwritten otherwise. Without `out` a new tensor in
    lora_b's dtype is returned (`add` does not apply).
    """
    parts = h if h.dim() == 3 else h.unsqueeze(1)
    if parts.dim() != 3 or lora_b.dim() != 3 or lora_b.shape[2] != parts.shape[2]:
        raise ValueError(
            f"h [T, (splits,) r_max] and lora_b [S, out, r_max] disagree: {list(h.shape)}, {list(lora_b.shape)}"
        )
    if lora_b.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {lora_b.dtype}")
    if parts.shape[1] > _MAX_SPLITS:
        raise ValueError(f"at most {_MAX_SPLITS} partials per token, got {parts.shape[1]}")
    _check_slots(slots, h.shape[0], h.device)
    _check_rows("h", h)
    _check_rows("lora_b", lora_b)
    tokens, splits, rank = parts.shape
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
        parts,
        slots,
        lora_b,
        out,
        out_features,
        rank,
        splits,
        parts.stride(0),
        parts.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        ADD=add,
        BLOCK_S=triton.next_power_of_2(splits),
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
    h = lora_shrink_partials(x, slots, lora_a, scaling)
    if out is None:
        out = torch.empty((x.shape[0], lora_b.shape[1]), dtype=x.dtype, device=x.device)
        return lora_expand(h, slots, lora_b, out=out, add=False)
    return lora_expand(h, slots, lora_b, out=out, add=True)

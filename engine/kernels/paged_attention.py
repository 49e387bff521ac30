"""Paged attention over block tables, as Triton kernels.

Cache layout (both K and V): [num_blocks, block_size, kv_heads, head_dim]. Sequence b's token j
lives in block block_tables[b, j // block_size] at offset j % block_size.

Two paths:
- `paged_attention` handles any mix of prefill chunks and decodes in one launch. Each program
  owns a tile of one sequence's query tokens for one KV head, with the GROUP query heads that
  share that KV head packed into the tile's rows (row = token * GROUP + head), so K and V are
  loaded once per group. Queries attend causally to the cached prefix plus the new tokens.
  Flash-attention style online softmax in fp32.
- `paged_decode_attention` is the decode-only path (one query token per sequence). It splits
  each sequence's KV range into NUM_SPLITS partitions processed by separate programs, so a
  small batch of long sequences still fills the GPU, then a second kernel merges the partial
  softmax results. Sequences with seq_len 0 (CUDA-graph padding) produce zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len  # tokens cached before this step

        rows = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dmask = dims < HEAD_DIM
        q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dmask[None, :], other=0.0)
        q_pos = ctx_len + tok

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        last_tok = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
        kv_end = ctx_len + last_tok + 1  # the last query of the tile sees keys [0, kv_end)
        for start in range(0, kv_end, BLOCK_N):
            kidx = start + tl.arange(0, BLOCK_N)
            kmask = kidx < kv_end
            block_ids = tl.load(block_tables_ptr + seq * stride_bt + kidx // BLOCK_SIZE, mask=kmask, other=0)
            kv_offs = (
                block_ids.to(tl.int64) * stride_cb + (kidx % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            )
            kv_mask = kmask[:, None] & dmask[None, :]
            k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            visible = (kidx[None, :] <= q_pos[:, None]) & kmask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dmask[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dmask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dmask[None, :],
        other=0.0,
    )

    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kidx = start + tl.arange(0, BLOCK_N)
        kmask = kidx < hi
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + kidx // BLOCK_SIZE, mask=kmask, other=0)
        kv_offs = block_ids.to(tl.int64) * stride_cb + (kidx % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # Partials: out [seq, head, split, dim] fp32; (m, l) [seq, head, split, 2] fp32.
    part_row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=row_valid[:, None])
    tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
    tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    smask = splits < NUM_SPLITS
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + splits) * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + (base + splits) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l_s > 0.0, tl.exp2(m - m_max) * l_s, 0.0)
    total = tl.sum(w, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :], mask=smask[:, None], other=0.0
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must have the same shape and strides")
    _, block_size, kv_heads, head_dim = k_cache.shape
    if q.shape[2] != head_dim or q.shape[1] % kv_heads or q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not match a cache of {kv_heads} KV heads x {head_dim}")
    return block_size, kv_heads, head_dim


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] (sequences packed by query_start_loc [B+1]) over the cache.

    seq_lens [B] counts each sequence's tokens including this step's; block_tables [B, max_blocks].
    """
    block_size, kv_heads, head_dim = _check_cache(q, k_cache, v_cache)
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=max(16, block_n),
        num_warps=4,
        num_stages=2,
    )
    return out


def decode_num_splits(max_seq_len: int, num_seqs: int, kv_heads: int, target_programs: int = 264) -> int:
    """Enough KV splits that seqs x kv_heads x splits fills the GPU, never more than ~1 per 256 keys."""
    programs = max(1, num_seqs * kv_heads)
    wanted = math.ceil(target_programs / programs)
    by_length = max(1, math.ceil(max_seq_len / 256))
    return int(max(1, min(wanted, by_length, 64)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, H, D], over each sequence's whole context.

    num_splits is a compile-time constant of the kernel; keep it fixed (e.g. per CUDA graph).
    """
    block_size, kv_heads, head_dim = _check_cache(q, k_cache, v_cache)
    num_seqs, num_heads, _ = q.shape
    group = num_heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty((num_seqs, num_heads, num_splits, dim_pad), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_ml,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=max(16, block_n),
        NUM_SPLITS=num_splits,
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_ml,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=1,
    )
    return out

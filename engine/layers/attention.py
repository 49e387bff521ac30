"""Paged attention: the per-step batch layout, the torch (CPU) and Triton (GPU) backends.

The runner orders a step's sequences decodes first (one query token each), then prefill chunks,
and flattens their tokens. `AttentionMetadata` describes that layout once per step; every layer
reuses it. KV caches are [num_blocks, block_size, kv_heads, head_dim] per layer, for K and V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillPlan:
    """One prefill chunk, for the torch backend."""

    q_start: int  # first of its tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens already cached before this chunk
    kv_slots: torch.Tensor | None  # cache slots of positions [0, ctx_len + q_len); None when ctx_len == 0
    causal_mask: torch.Tensor | None  # [q_len, ctx_len + q_len] bool; None when ctx_len == 0


@dataclass
class DecodeGroup:
    """Decodes of similar context length, for the torch backend: gathered and attended together,
    padded only to the group's longest context."""

    start: int  # first sequence (= first token) of the group in the flat batch
    count: int
    blocks: torch.Tensor  # [count * group_blocks] int64, row-major block ids to gather
    bias: torch.Tensor  # [count, 1, 1, group_blocks * block_size]: 0 for real positions, -inf past the end


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (negative: padding, skipped)
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens per sequence including this step's
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    # torch backend only
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillPlan] = field(default_factory=list)
    # Triton backend only: KV splits of the decode kernel (fixed per CUDA graph)
    decode_num_splits: int = 1


def build_attention_metadata(
    query_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    torch_plan: bool,
    decode_num_splits: int = 1,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Layout tensors for sequences already ordered decodes-first, and every new token's position.

    query_lens: new tokens per sequence; ctx_lens: tokens cached before this step.
    """
    num_seqs = len(query_lens)
    num_decodes = 0
    while num_decodes < num_seqs and query_lens[num_decodes] == 1:
        num_decodes += 1
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens, strict=True)]
    max_blocks = max((len(t) for t in block_tables), default=0)
    table = torch.zeros((num_seqs, max(1, max_blocks)), dtype=torch.int64)
    for i, t in enumerate(block_tables):
        if t:
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    qlen = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(ctx_lens, dtype=torch.int64)
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(qlen, 0, out=query_start[1:])
    total = int(query_start[-1])
    # Slot of every new token: position p of sequence i -> table[i, p // bs] * bs + p % bs.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlen)
    positions = ctx[seq_of_token] + (torch.arange(total) - query_start[:-1][seq_of_token])
    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size

    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device=device, dtype=torch.int32),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decodes=num_decodes,
        decode_num_splits=decode_num_splits,
    )
    if torch_plan:
        _plan_torch(meta, table, seq_lens, query_lens, ctx_lens, query_start, block_size, device)
    return meta, positions.to(device)


def _group_by_length(lens: list[int], max_groups: int = 8) -> list[tuple[int, int]]:
    """Split consecutive sequences into (start, count) runs of similar length, so a short context
    is not padded to a long one. Effective when the caller sorted them by length (the runner does);
    correct in any order."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lens)):
        if len(groups) < max_groups - 1 and lens[i] > 1.25 * lens[start] + 32:
            groups.append((start, i - start))
            start = i
    if lens:
        groups.append((start, len(lens) - start))
    return groups


def _context_slots(table_rows: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for each row of block ids: [rows, length]."""
    pos = torch.arange(length, device=table_rows.device)
    return table_rows[:, pos // block_size] * block_size + pos % block_size


def _plan_torch(
    meta: AttentionMetadata,
    table: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    ctx_lens: list[int],
    query_start: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> None:
    nd = meta.num_decodes
    for start, count in _group_by_length(seq_lens[:nd]):
        lens = seq_lens[start : start + count]
        # Whole blocks are gathered (index_select of 16-token rows is far cheaper than per-token
        # indexing); positions past each sequence's length are masked out.
        num_blocks = -(-max(lens) // block_size)
        blocks = table[start : start + count, :num_blocks].reshape(-1)
        valid = torch.arange(num_blocks * block_size)[None, :] < torch.tensor(lens)[:, None]
        bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
        meta.decode_groups.append(
            DecodeGroup(start, count, blocks.to(device), bias[:, None, None, :].to(device))
        )
    for i in range(nd, len(query_lens)):
        q_len, ctx_len = query_lens[i], ctx_lens[i]
        slots = mask = None
        if ctx_len:
            total = ctx_len + q_len
            slots = _context_slots(table[i : i + 1], total, block_size)[0].to(device)
            mask = (torch.arange(total)[None, :] <= (ctx_len + torch.arange(q_len))[:, None]).to(device)
        meta.prefills.append(PrefillPlan(int(query_start[i]), q_len, ctx_len, slots, mask))


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference KV store; negative slots (padding) are skipped."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The plainest correct paged attention, one sequence at a time (the kernels' test oracle)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for i in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        seq_len = int(seq_lens[i])
        if end == start or seq_len == 0:
            continue
        slots = _context_slots(block_tables[i : i + 1].long().cpu(), seq_len, block_size)[0].to(q.device)
        keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        values = v_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        queries = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


class TorchAttentionBackend:
    """CPU attention. Decodes run as one batched, padded gather + matmul (no per-token Python);
    prefill chunks run one SDPA call each."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        out = torch.empty_like(q)
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        for g in meta.decode_groups:
            span = g.bias.shape[-1]
            keys = k_cache.index_select(0, g.blocks).view(g.count, span, kv_heads, head_dim).transpose(1, 2)
            values = v_cache.index_select(0, g.blocks).view(g.count, span, kv_heads, head_dim).transpose(1, 2)
            # The GQA group's query heads ride in the query-length slot: [n, kv_heads, group, D]
            # attends like MHA with no K/V head expansion (a decode query sees its whole context).
            group = q.shape[1] // kv_heads
            rows = slice(g.start, g.start + g.count)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].reshape(g.count, kv_heads, group, head_dim),
                keys,
                values,
                attn_mask=g.bias,
                scale=scale,
            ).reshape(g.count, kv_heads * group, head_dim)
        for p in meta.prefills:
            qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.kv_slots is None:
                keys = k[p.q_start : p.q_start + p.q_len]
                values = v[p.q_start : p.q_start + p.q_len]
            else:
                keys, values = k_flat.index_select(0, p.kv_slots), v_flat.index_select(0, p.kv_slots)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=p.causal_mask,
                is_causal=p.causal_mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out


class TritonAttentionBackend:
    """GPU attention: Triton KV store, then the split-KV decode kernel for all-decode batches
    (the CUDA-graph case) or the mixed prefill+decode kernel otherwise."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        from kvgate.engine.kernels.kv_store import store_kv
        from kvgate.engine.kernels.paged_attention import paged_attention, paged_decode_attention

        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_decodes == meta.seq_lens.shape[0]:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.decode_num_splits
            )
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
        )


AttentionBackend = TorchAttentionBackend | TritonAttentionBackend


class Attention(nn.Module):
    """Scaled dot-product attention of new tokens over the paged KV cache of one layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)

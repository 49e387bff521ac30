"""CUDA graphs for all-decode steps.

A decode step of a small model is dominated by kernel-launch overhead (hundreds of launches per
step). We capture the model's forward once per batch-size bucket over static input buffers and
replay it: a step becomes a few host->device copies plus one graph launch. A batch is padded up
to its bucket; padding rows write no KV (slot -1) and attend to nothing (seq_len 0).

Sampling stays outside the graph (it is per-request Python).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.engine.kernels.paged_attention import decode_num_splits
from kvgate.engine.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from kvgate.engine.model_runner import TorchModelRunner

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass
class _Buffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor


class DecodeGraphs:
    def __init__(self, runner: TorchModelRunner, sizes: list[int]):
        self.runner = runner
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.block_size = runner.block_size
        self.max_blocks = math.ceil(runner.max_model_len / runner.block_size)
        device = runner.device
        n = self.max_size
        self.buffers = _Buffers(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            block_tables=torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:size],
            query_start_loc=b.query_start_loc[: size + 1],
            seq_lens=b.seq_lens[:size],
            block_tables=b.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.runner.max_model_len,
            num_decodes=size,
            decode_num_splits=decode_num_splits(
                self.runner.max_model_len, size, self.runner.model_config.num_kv_heads
            ),
        )

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        return self.runner.model(
            b.input_ids[:size], b.positions[:size], self.runner.kv_caches, self._meta(size)
        )

    @classmethod
    def capture(cls, runner: TorchModelRunner) -> DecodeGraphs:
        self = cls(runner, bucket_sizes(runner.config.max_num_seqs))
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Padding-shaped inputs: nothing is written to the KV cache during capture.
            self.buffers.seq_lens.fill_(1)
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
                self._forward(size)  # compiles the Triton kernels outside the capture
                torch.cuda.synchronize(runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
            self.buffers.seq_lens.zero_()
        torch.cuda.synchronize(runner.device)
        log.info("captured CUDA graphs for decode batches of %s sequences", self.sizes)
        return self

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_size

    def run(self, token_ids: list[int], ctx_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [len(token_ids), hidden] for one decode token per sequence."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        table = torch.zeros((size, self.max_blocks), dtype=torch.int32)
        slots = torch.full((size,), -1, dtype=torch.long)
        for i, (row, pos) in enumerate(zip(block_tables, ctx_lens, strict=True)):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            slots[i] = row[pos // bs] * bs + pos % bs
        pad = size - n
        ids = torch.tensor(token_ids + [0] * pad, dtype=torch.long)
        positions = torch.tensor(ctx_lens + [0] * pad, dtype=torch.long)
        seq_lens = torch.tensor([c + 1 for c in ctx_lens] + [0] * pad, dtype=torch.int32)
        b = self.buffers
        b.input_ids[:size].copy_(ids, non_blocking=True)
        b.positions[:size].copy_(positions, non_blocking=True)
        b.slot_mapping[:size].copy_(slots, non_blocking=True)
        b.seq_lens[:size].copy_(seq_lens, non_blocking=True)
        b.block_tables[:size].copy_(table, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:n]

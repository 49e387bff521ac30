"""Batched multi-LoRA: the delta several adapters add to one projection in one step.

Every token of a batch carries the slot of its request's adapter (-1: the base model). The
adapters' weights are stacked per slot, ranks below the stack's r_max zero-padded, so one
call serves a batch that mixes adapters of any rank <= r_max and base-model tokens:

    delta[t] = scaling[s] * lora_b[s] @ (lora_a[s] @ x[t])   with s = slots[t]; 0 when s == -1

`lora_delta` / `add_lora_delta` dispatch: the Triton kernel (engine/kernels/lora.py) on CUDA,
the torch path (grouped by slot) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lora_delta_torch(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """x [T, in], slots [T] int64, lora_a [S, r_max, in], lora_b [S, out, r_max], scaling [S]
    -> [T, out]. Grouped by slot: two small GEMMs per distinct adapter in the batch."""
    return grouped_lora_delta(x, slot_groups(slots), lora_a, lora_b, scaling)


def slot_groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows) for each adapter slot present; base-model tokens (-1) left out."""
    return [
        (slot, (slots == slot).nonzero().squeeze(1)) for slot in torch.unique(slots).tolist() if slot >= 0
    ]


def grouped_lora_delta(
    x: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot, rows in groups:
        shrunk = x.index_select(0, rows) @ lora_a[slot].t()  # [n, r_max]
        out.index_copy_(0, rows, (shrunk @ lora_b[slot].t()) * scaling[slot])
    return out


def lora_delta(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """The delta as a new [T, out] tensor: the Triton kernel on CUDA, torch otherwise."""
    if x.is_cuda:
        out = x.new_zeros(x.shape[0], lora_b.shape[1])
        add_lora_delta(out, x, slots, lora_a, lora_b, scaling)
        return out
    return lora_delta_torch(x, slots, lora_a, lora_b, scaling)


def add_lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """out += delta, in place (the kernel accumulates straight into the projection's output)."""
    if x.is_cuda:
        # Lazily: the CPU path never imports triton.
        from kvgate.engine.kernels.lora import lora_delta_triton

        lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=out)
    else:
        out += lora_delta_torch(x, slots, lora_a, lora_b, scaling)


@dataclass
class LoRABatch:
    """This step's per-token adapter slots, shared by every LoRA-wrapped projection of the
    model. `slots` is None for a step without adapters: projections then skip LoRA entirely."""

    slots: torch.Tensor | None = None
    scaling: torch.Tensor | None = None  # [S], one per slot
    # The torch path's grouping of `slots`, computed once per step rather than per projection.
    groups: list[tuple[int, torch.Tensor]] | None = None


@dataclass
class LoRAWeights:
    """One projection's stacked adapter weights: lora_a [S, r_max, in], lora_b [S, out, r_max].
    A fused projection (q|k|v, gate|up) stacks its shards' ranks side by side (A rows) and
    places each shard's B in its own block of rows and rank columns, so one call covers it."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    batch: LoRABatch

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """[T, out], or None in a step without adapters."""
        batch = self.batch
        if batch.slots is None or batch.scaling is None:
            return None
        if batch.groups is not None and not x.is_cuda:
            return grouped_lora_delta(x, batch.groups, self.lora_a, self.lora_b, batch.scaling)
        return lora_delta(x, batch.slots, self.lora_a, self.lora_b, batch.scaling)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += this step's delta (nothing in a step without adapters)."""
        batch = self.batch
        if batch.slots is None or batch.scaling is None:
            return
        if batch.groups is not None and not x.is_cuda:
            out += grouped_lora_delta(x, batch.groups, self.lora_a, self.lora_b, batch.scaling)
        else:
            add_lora_delta(out, x, batch.slots, self.lora_a, self.lora_b, batch.scaling)

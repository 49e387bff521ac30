"""LoRA adapter slots for the real model runner.

`max_loras` slots of stacked A/B weights per LoRA-wrapped projection live on the model's
device; every registered adapter is known by its path, and up to `max_cpu_loras` of them are
kept parsed in CPU memory (LRU; an adapter pushed out is read from disk again when needed).
Before each step `prepare` puts the step's adapters into slots (evicting the least recently
used slot that no running request needs; the scheduler admits at most `max_loras` adapters at
once so one always exists) and builds the per-token slot index the projections read. Putting
an adapter into a slot is a copy of its small tensors, done before the step that first needs
it: it never stalls the running batch more than that one step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvgate.engine.core.runner_api import ScheduledSeq
from kvgate.engine.layers.linear import Linear, MergedLinear
from kvgate.engine.layers.lora import LoRABatch, LoRAWeights, slot_groups
from kvgate.engine.loader.peft import LoRAAdapter, load_peft_adapter
from kvgate.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Our fused projection -> the Hugging Face projections it stacks, in shard order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class _Registered:
    name: str
    path: str


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.device, self.dtype = device, dtype
        self.batch = LoRABatch()
        self.scaling = torch.zeros(max_loras, dtype=dtype, device=device)
        self.slot_ids: list[int | None] = [None] * max_loras  # lora id held by each slot
        self._slot_clock = [0] * max_loras  # last step each slot served (LRU)
        self._clock = 0
        self.registered: dict[int, _Registered] = {}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, newest last
        self.slot_loads_total = 0
        # (layer, our projection) -> the module and its stacked weights
        self.targets: dict[tuple[int, str], tuple[Linear, LoRAWeights]] = {}
        for index, layer in enumerate(model.layers):
            for fused, shards in FUSED.items():
                block = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
                module = getattr(block, fused)
                assert isinstance(module, Linear)
                rank = max_rank * len(shards)
                weights = LoRAWeights(
                    torch.zeros(max_loras, rank, module.in_features, dtype=dtype, device=device),
                    torch.zeros(max_loras, module.out_features, rank, dtype=dtype, device=device),
                    self.batch,
                )
                module.lora = weights
                self.targets[(index, fused)] = (module, weights)

    # -- registry (the engine thread, between steps) ---------------------------------------------
    def load(self, name: str, path: str) -> LoRAAdapter:
        """Parse and check an adapter folder (any thread: touches no manager state)."""
        return load_peft_adapter(name, path, self.model.config, self.max_rank)

    def add(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.registered[lora_id] = _Registered(adapter.name, adapter.path)
        self._cache(lora_id, adapter)
        # A re-registered name may bring new weights: its slot holds the old ones.
        self._drop_slot(lora_id)

    def remove(self, lora_id: int) -> None:
        self.registered.pop(lora_id, None)
        self.cpu.pop(lora_id, None)
        self._drop_slot(lora_id)

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.cpu[lora_id] = adapter
        self.cpu.move_to_end(lora_id)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _drop_slot(self, lora_id: int) -> None:
        if lora_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_id)] = None

    # -- a step ------------------------------------------------------------------------------------
    def prepare(self, seqs: list[ScheduledSeq], keep: frozenset[int]) -> None:
        """Slot the step's adapters and set the per-token slot index (None: a base-only step)."""
        wanted = {s.lora_id for s in seqs if s.lora_id is not None}
        if not wanted:
            self.batch.slots = self.batch.scaling = self.batch.groups = None
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters, over max_loras {self.max_loras}")
        self._clock += 1
        slot_of: dict[int, int] = {}
        for lora_id in sorted(wanted):
            if lora_id in self.slot_ids:
                slot_of[lora_id] = self.slot_ids.index(lora_id)
        for lora_id in sorted(wanted - set(slot_of)):
            slot = self._free_slot(wanted, keep)
            self._fill(slot, lora_id)
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._slot_clock[slot] = self._clock
        per_seq = [slot_of[s.lora_id] if s.lora_id is not None else -1 for s in seqs]
        lengths = [len(s.token_ids) for s in seqs]
        slots = torch.tensor(per_seq, dtype=torch.long).repeat_interleave(torch.tensor(lengths))
        self.batch.slots = slots.to(self.device)
        self.batch.scaling = self.scaling
        # CPU: group the tokens by slot once for all projections of the step (the GPU kernel
        # gathers per token and needs no grouping).
        self.batch.groups = slot_groups(slots) if self.device.type == "cpu" else None

    def _free_slot(self, wanted: set[int], keep: frozenset[int]) -> int:
        """An empty slot, else the least recently used one that no running request needs."""
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        candidates = [i for i, held in enumerate(self.slot_ids) if held not in wanted and held not in keep]
        if not candidates:
            # More adapters running than slots (the scheduler's max_loras limit prevents it):
            # take one that this step does not use; it is put back when its requests run again.
            candidates = [i for i, held in enumerate(self.slot_ids) if held not in wanted]
        return min(candidates, key=lambda i: self._slot_clock[i])

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self.cpu.get(lora_id)
        if adapter is not None:
            self.cpu.move_to_end(lora_id)
            return adapter
        entry = self.registered.get(lora_id)
        if entry is None:
            raise RuntimeError(f"LoRA id {lora_id} is not registered")
        # Pushed out of the CPU cache: read it again (it was valid when registered).
        log.info("LoRA adapter %s: reloading from %s", entry.name, entry.path)
        adapter = self.load(entry.name, entry.path)
        self._cache(lora_id, adapter)
        return adapter

    def _fill(self, slot: int, lora_id: int) -> None:
        adapter = self._adapter(lora_id)
        rank = adapter.rank
        for (layer, fused), (module, weights) in self.targets.items():
            a_dst, b_dst = weights.lora_a[slot], weights.lora_b[slot]
            a_dst.zero_()
            b_dst.zero_()
            for shard, proj in enumerate(FUSED[fused]):
                pair = adapter.weights.get((layer, proj))
                if pair is None:
                    continue
                a, b = pair
                cols = slice(shard * self.max_rank, shard * self.max_rank + rank)
                if isinstance(module, MergedLinear):
                    rows = slice(module.offsets[shard], module.offsets[shard] + module.output_sizes[shard])
                else:
                    rows = slice(0, module.out_features)
                a_dst[cols].copy_(a)
                b_dst[rows, cols].copy_(b)
        self.scaling[slot] = adapter.scaling
        self.slot_ids[slot] = lora_id
        self.slot_loads_total += 1

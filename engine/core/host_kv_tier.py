"""The second KV tier: full blocks kept in host memory under the prefix cache (vLLM's native
CPU offloading, `--kv-offloading-size`).

The tier is an LRU map from a block's hash to a slot of the runner's host KV pool. It only keeps
the bookkeeping; the runner moves the bytes, told by the step's `ScheduledBatch` which device
blocks to save into which slots and which slots to load into which device blocks (saves run
before loads, and both before the step computes anything). A slot that a step loads from is
pinned until that step has run, so no save of the same step can reuse it.

Every block that becomes findable here is announced as a `BlockStored` with medium "CPU", and
every one that stops being findable as a `BlockRemoved` with medium "CPU", into the same event
list the device pool writes to, so a subscriber sees both tiers' changes in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.api.contracts.kv_events import BlockRemoved, BlockStored, KVEvent

HOST_MEDIUM = "CPU"


@dataclass(slots=True)
class HostBlock:
    slot: int
    lora_id: int | None
    pins: int = 0  # steps about to load from it


class HostKVTier:
    def __init__(self, num_blocks: int, block_size: int, events: list[KVEvent]) -> None:
        if num_blocks < 1:
            raise ValueError("the host KV tier needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._events = events
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._blocks: OrderedDict[int, HostBlock] = OrderedDict()  # hash -> block; LRU first
        self._pinned: list[HostBlock] = []
        self._freed_after_step: list[int] = []  # slots of dropped blocks a pending load still reads
        self.stores_total = 0  # blocks written to the tier
        self.loads_total = 0  # blocks read back from it

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    def usage(self) -> float:
        return len(self._blocks) / self.num_blocks

    def lookup(self, block_hash: int) -> HostBlock | None:
        return self._blocks.get(block_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def store(
        self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], lora_id: int | None
    ) -> int | None:
        """Find a slot for this block (evicting the least recently used unpinned one when full)
        and announce it. Returns the slot to save the block's KV into, or None when the tier
        holds it already (it only becomes the most recently used) or every slot is pinned."""
        held = self._blocks.get(block_hash)
        if held is not None:
            self._blocks.move_to_end(block_hash)
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, b in self._blocks.items() if not b.pins), None)
            if victim is None:
                return None
            slot = self._blocks.pop(victim).slot
            self._events.append(BlockRemoved(block_hashes=[victim], medium=HOST_MEDIUM))
        self._blocks[block_hash] = HostBlock(slot, lora_id)
        self._events.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=parent_hash,
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=lora_id,
                medium=HOST_MEDIUM,
            )
        )
        self.stores_total += 1
        return slot

    def pin_for_load(self, blocks: Sequence[HostBlock]) -> None:
        """These blocks are read by the step being scheduled: keep their slots until `unpin_all`.
        A hit also makes them the most recently used."""
        for block in blocks:
            block.pins += 1
            self._pinned.append(block)
        self.loads_total += len(blocks)

    def touch(self, block_hash: int) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)

    def unpin_all(self) -> None:
        """The step that loaded the pinned blocks has run."""
        for block in self._pinned:
            block.pins -= 1
        self._pinned.clear()
        self._free_slots.extend(self._freed_after_step)
        self._freed_after_step.clear()

    def forget_lora(self, lora_id: int) -> int:
        """Drop every block computed with this adapter (its weights changed). The slot of one a
        pending load still reads is reused only after that step."""
        gone = [h for h, b in self._blocks.items() if b.lora_id == lora_id]
        for h in gone:
            self._drop(self._blocks.pop(h))
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=HOST_MEDIUM))
        return len(gone)

    def clear(self) -> None:
        """Forget every block (the device pool announces AllBlocksCleared for both tiers)."""
        for block in self._blocks.values():
            self._drop(block)
        self._blocks.clear()

    def _drop(self, block: HostBlock) -> None:
        (self._freed_after_step if block.pins else self._free_slots).append(block.slot)

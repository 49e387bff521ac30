"""A pool of fixed-size KV blocks: reference counts, free queues and the prefix-cache map.

A block whose last user freed it keeps its hash and stays findable by prefix lookups until the
pool needs it for something else. Eviction is LRU in two tiers (segmented LRU): blocks never
reused from the cache (a user's own question, a prompt seen once) are evicted before blocks a
later request has hit (a shared system prompt), least recently freed first within each tier.
Plain LRU lets a stream of one-off prompt tails push out the prefixes that every request of a
group shares, whenever that group is quieter than the tails are many; with the two tiers the
tails go first. Blocks that hold nothing cacheable are reused before any cached block is
evicted. Every change to the cached set is recorded as a KV event.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_U64 = struct.Struct("<Q")
_NO_PARENT = 0x6B7667617465  # seed for the first block of a chain ("kvgate")
_NO_LORA = 0xFFFFFFFFFFFFFFFF
# What `hash_block_tokens` hashes with: vllm:cache_config_info's prefix_caching_hash_algo label.
HASH_ALGO = "blake2b"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_key: int | None = None) -> int:
    """Stable 64-bit hash of one full block, chained from its parent block's hash.

    blake2b is in the standard library and stable across processes and hosts (Python's `hash`
    is salted per process), so the values can go on the wire as uint64.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(_U64.pack(_NO_PARENT if parent_hash is None else parent_hash))
    h.update(_U64.pack(_NO_LORA if extra_key is None else extra_key & 0xFFFFFFFFFFFFFFFF))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache
    hits: int = 0  # times a prefix lookup reused it since it was cached
    lora_id: int | None = None  # the adapter its KV was computed with, while registered
    # While registered: the hash of the block before it and its tokens, so that the block can
    # still be announced elsewhere (the host tier) when it leaves this pool.
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class NoFreeBlocksError(RuntimeError):
    pass


EvictHook = Callable[[KVBlock], None]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: list[KVEvent] | None = None,
        on_evict: EvictHook | None = None,
    ) -> None:
        """`events`: where to record KV events (shared with a host tier, to keep one order);
        `on_evict`: called with each cached block `take` evicts, before it loses its hash."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block; order = eviction order (front first). OrderedDict gives O(1)
        # removal from the middle when a prefix hit revives a free cached block. `_free` holds
        # uncached blocks and cached ones nobody reused; `_free_reused` the reused ones, taken
        # only once `_free` is empty.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._free_reused: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}
        self._events: list[KVEvent] = [] if events is None else events
        self._on_evict = on_evict

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_reused)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_free(self, block: KVBlock) -> bool:
        """In a free queue (either tier): no request holds it."""
        return block.block_id in self._free or block.block_id in self._free_reused

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    # -- allocation ----------------------------------------------------------------------
    def take(self, n: int) -> list[KVBlock]:
        """Take `n` blocks off the front of the free queue, evicting their cached contents."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        evicted: list[int] = []
        for _ in range(n):
            _, block = (self._free or self._free_reused).popitem(last=False)
            block.hits = 0
            if block.block_hash is not None:
                if self._on_evict is not None:
                    self._on_evict(block)
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                _unregister(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to prefix-cache hits, reviving any that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self._free_reused if block.hits else self._free).pop(block.block_id)
            block.ref_cnt += 1
            block.hits += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; pass them tail-first so tails get evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.hits and block.block_hash is not None:
                    self._free_reused[block.block_id] = block
                    continue
                self._free[block.block_id] = block
                if block.block_hash is None:
                    # Nothing to keep: reuse it before evicting any cached block.
                    self._free.move_to_end(block.block_id, last=False)
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} released more often than taken")

    # -- prefix cache --------------------------------------------------------------------
    def register(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_id: int | None,
    ) -> None:
        """Make full, computed blocks findable by hash and record one BlockStored for them.

        `token_ids` covers exactly these blocks. A block whose hash another block already holds
        (two requests computed the same prefix at once) stays private; the event then lists
        only the blocks that became findable, split wherever the chain has a gap.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        run_start = -1
        run_parent = parent_hash
        prev = parent_hash
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            stored = block.block_hash is None and h not in self._cached
            if stored:
                block.block_hash = h
                block.lora_id = lora_id
                block.parent_hash = prev
                block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
                self._cached[h] = block
                if run_start < 0:
                    run_start, run_parent = i, prev
            elif run_start >= 0:
                self._emit_stored(
                    hashes[run_start:i], run_parent, token_ids[run_start * bs : i * bs], lora_id
                )
                run_start = -1
            prev = h
        if run_start >= 0:
            end = len(hashes)
            self._emit_stored(
                hashes[run_start:end], run_parent, token_ids[run_start * bs : end * bs], lora_id
            )

    def _emit_stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], lora_id: int | None
    ) -> None:
        self._events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=lora_id,
            )
        )

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Blocks in use stay with their requests, just no longer findable."""
        for block in self._cached.values():
            _unregister(block)
            block.hits = 0
        self._cached.clear()
        # Nothing is worth keeping any more: reuse these before the rest of the queue.
        while self._free_reused:
            block_id, block = self._free_reused.popitem()
            self._free[block_id] = block
            self._free.move_to_end(block_id, last=False)
        self._events.append(AllBlocksCleared())

    def forget_lora(self, lora_id: int) -> int:
        """Make every block cached under this adapter unfindable (its weights changed, so that
        KV is wrong for every later request) and record one BlockRemoved for them. Blocks that
        requests still hold stay with them; free ones are reused before any cached block.
        Returns how many blocks were forgotten."""
        gone: list[int] = []
        for block_hash, block in list(self._cached.items()):
            if block.lora_id != lora_id:
                continue
            del self._cached[block_hash]
            gone.append(block_hash)
            _unregister(block)
            block.hits = 0
            if block.block_id in self._free_reused:
                del self._free_reused[block.block_id]
                self._free[block.block_id] = block
            if block.block_id in self._free:
                self._free.move_to_end(block.block_id, last=False)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone))
        return len(gone)

    def drain_events(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()  # in place: a host tier appends to the same list
        return events


def _unregister(block: KVBlock) -> None:
    block.block_hash = None
    block.lora_id = None
    block.parent_hash = None
    block.token_ids = ()

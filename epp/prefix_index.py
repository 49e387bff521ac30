"""Which endpoint holds which prompt prefix: a precise index fed by KV events, an approximate one
fed by our own routing decisions.

Both are keyed by kvgate's own chained block hash over token ids, never by an engine's hash
scheme: engines differ (and vLLM's hash is salted per process), so an engine hash is only used
to find which of our keys a ``BlockRemoved`` refers to.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("kvgate.epp.prefix_index")

# Seeds the chain so a LoRA adapter's blocks never collide with the base model's.
_ROOT = 0x6B7667617465  # "kvgate"


def root_key(lora_id: int | None = None) -> int:
    return hash((_ROOT, lora_id))


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    # Tuple hashing of ints is deterministic across runs (no hash randomisation for ints) and
    # runs in C: ~0.2 µs per 16-token block.
    return hash((parent, *tokens))


def block_keys(token_ids: Sequence[int], block_size: int, lora_id: int | None = None) -> list[int]:
    """Keys of every *full* block of a prompt, each chained from the one before it."""
    keys: list[int] = []
    parent = root_key(lora_id)
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class _EndpointBlocks:
    engine_to_key: dict[int, int] = field(default_factory=dict)
    key_refs: dict[int, int] = field(default_factory=dict)  # one key may back several engine hashes
    block_size: int | None = None  # the engine's KV block size, as its events say


class PreciseIndex:
    """Per-endpoint set of cached blocks, maintained from the engine's own KV events."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._holders: dict[int, set[str]] = {}
        self.orphan_blocks = 0  # stored blocks whose parent we never saw (lost events)

    # -- writes (KV-event subscriber) --------------------------------------------------------
    def apply(self, endpoint: str, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(endpoint, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(endpoint, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(endpoint)

    def _stored(self, endpoint: str, ev: BlockStored) -> None:
        blocks = self._endpoints.setdefault(endpoint, _EndpointBlocks())
        if ev.parent_block_hash is None:
            parent = root_key(ev.lora_id)
        else:
            found = blocks.engine_to_key.get(ev.parent_block_hash)
            if found is None:
                # Without the parent we cannot compute where these blocks sit in a prompt.
                self.orphan_blocks += len(ev.block_hashes)
                return
            parent = found
        size = ev.block_size
        if size <= 0:
            return  # malformed: no block can be placed
        if blocks.block_size != size:
            log.info("endpoint %s: KV block size %d tokens (from its KV events)", endpoint, size)
            blocks.block_size = size
        for i, engine_hash in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * size : (i + 1) * size]
            if len(tokens) < size:
                break  # only full blocks are cacheable; anything shorter is malformed
            parent = chain_key(parent, tokens)
            if engine_hash in blocks.engine_to_key:
                continue  # re-announced (e.g. after replay): already counted
            blocks.engine_to_key[engine_hash] = parent
            refs = blocks.key_refs.get(parent, 0)
            blocks.key_refs[parent] = refs + 1
            if refs == 0:
                self._holders.setdefault(parent, set()).add(endpoint)

    def _removed(self, endpoint: str, engine_hashes: Iterable[int]) -> None:
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            return
        for engine_hash in engine_hashes:
            key = blocks.engine_to_key.pop(engine_hash, None)
            if key is None:
                continue
            refs = blocks.key_refs[key] - 1
            if refs:
                blocks.key_refs[key] = refs
                continue
            del blocks.key_refs[key]
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self._holders[key]

    def clear(self, endpoint: str) -> None:
        blocks = self._endpoints.pop(endpoint, None)
        if blocks is None:
            return
        for key in blocks.key_refs:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self._holders[key]

    # -- reads (scheduler) -------------------------------------------------------------------
    def block_size(self, endpoint: str) -> int | None:
        """The endpoint's KV block size, learnt from its events; None before the first."""
        blocks = self._endpoints.get(endpoint)
        return blocks.block_size if blocks else None

    def block_count(self, endpoint: str) -> int:
        blocks = self._endpoints.get(endpoint)
        return len(blocks.key_refs) if blocks else 0

    def holders(self, key: int) -> frozenset[str]:
        return frozenset(self._holders.get(key, ()))

    def prefix_blocks(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Per endpoint: how many of ``keys``, counted from the first, it holds consecutively."""
        return _longest_prefix(keys, endpoints, self._holders.get)


class ApproximateIndex:
    """What this EPP routed where: an LRU of block keys → {endpoint: when}, bounded in size.

    Used for endpoints that publish no KV events (GIE's approximate prefix-cache scorer), and
    to bridge the few milliseconds before an engine's ``BlockStored`` arrives.
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, dict[str, float]] = OrderedDict()

    def record(self, keys: Iterable[int], endpoint: str, when: float = 0.0) -> None:
        lru = self._lru
        for key in keys:
            holders = lru.get(key)
            if holders is None:
                lru[key] = {endpoint: when}
            else:
                holders[endpoint] = when
                lru.move_to_end(key)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def forget_endpoint(self, endpoint: str) -> None:
        for key in [k for k, h in self._lru.items() if endpoint in h]:
            holders = self._lru[key]
            del holders[endpoint]
            if not holders:
                del self._lru[key]

    def __len__(self) -> int:
        return len(self._lru)

    def prefix_blocks(
        self, keys: Sequence[int], endpoints: Iterable[str], since: float | None = None
    ) -> dict[str, int]:
        """Like ``PreciseIndex.prefix_blocks``; with ``since``, only records made at or after it count."""
        if since is None:
            return _longest_prefix(keys, endpoints, self._lru.get)
        lru = self._lru

        def recent_holders(key: int) -> set[str]:
            return {ep for ep, at in (lru.get(key) or {}).items() if at >= since}

        return _longest_prefix(keys, endpoints, recent_holders)


def _longest_prefix(
    keys: Sequence[int], endpoints: Iterable[str], lookup: Callable[[int], Collection[str] | None]
) -> dict[str, int]:
    alive = set(endpoints)
    result = dict.fromkeys(alive, 0)
    depth = 0
    for key in keys:
        holders = lookup(key)
        if not holders:
            break
        still = alive.intersection(holders)
        if len(still) != len(alive):
            for ep in alive - still:
                result[ep] = depth
            alive = still
            if not alive:
                return result
        depth += 1
    for ep in alive:
        result[ep] = depth
    return result

"""Which endpoint holds which prompt prefix: a precise index fed by KV events, an approximate one
fed by our own routing decisions.

Both are keyed by kvgate's own chained block hash over token ids, never by an engine's hash
scheme: engines differ (and vLLM's hash is salted per process), so an engine hash is only used
to find which of our keys a ``BlockRemoved`` refers to.

The precise index keeps two tiers per endpoint, as the events' ``medium`` says: the device
("GPU", or no medium: older engines) and the host tier ("CPU", vLLM's CPU offloading), whose
blocks the engine loads back instead of computing. A block may sit in both.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from kvgate.api.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("kvgate.epp.prefix_index")

# Seeds the chain so a LoRA adapter's blocks never collide with the base model's.
_ROOT = 0x6B7667617465  # "kvgate"


def root_key(lora_id: int | None = None) -> int:
    # -1, not None: before Python 3.12 hash(None) is None's address, so keys (and the block
    # sample the latency scorer takes of them) differed per process and per EPP replica.
    return hash((_ROOT, -1 if lora_id is None else lora_id))


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    # Tuple hashing of ints is deterministic across runs (no hash randomisation for ints) and
    # runs in C: ~0.15 µs per 16-token block.
    return hash((parent, tuple(tokens)))


def block_keys(token_ids: Sequence[int], block_size: int, lora_id: int | None = None) -> list[int]:
    """Keys of every *full* block of a prompt, each chained from the one before it."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, not {block_size}")
    parent = root_key(lora_id)
    # chain_key inlined, blocks cut by zip over one iterator (a partial last block is dropped):
    # this runs once per pick over ~450 blocks of a 7k-token prompt, and slicing and a call per
    # block were most of its cost. The keys are chain_key's, block for block.
    tokens = iter(token_ids)
    return [parent := hash((parent, block)) for block in zip(*[tokens] * block_size, strict=False)]


def common_prefix_blocks(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """How many leading block keys two prompts share (``known``: at least that many, already
    established). Keys are chained, so equal keys at a position mean equal prompts up to it:
    a binary search finds the end in O(log n)."""
    lo, hi = known, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


HOST_MEDIUMS = frozenset({"CPU", "cpu"})


@dataclass
class _TierBlocks:
    engine_to_key: dict[int, int] = field(default_factory=dict)
    key_refs: dict[int, int] = field(default_factory=dict)  # one key may back several engine hashes

    def remove(self, engine_hash: int) -> int | None:
        """Forget one engine hash; returns its key when no other engine hash backs it any more."""
        key = self.engine_to_key.pop(engine_hash, None)
        if key is None:
            return None
        refs = self.key_refs[key] - 1
        if refs:
            self.key_refs[key] = refs
            return None
        del self.key_refs[key]
        return key


@dataclass
class _EndpointBlocks:
    device: _TierBlocks = field(default_factory=_TierBlocks)
    host: _TierBlocks = field(default_factory=_TierBlocks)
    block_size: int | None = None  # the engine's KV block size, as its events say

    def parent_key(self, engine_hash: int) -> int | None:
        found = self.device.engine_to_key.get(engine_hash)
        return self.host.engine_to_key.get(engine_hash) if found is None else found


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
                if ev.medium in HOST_MEDIUMS:
                    self._removed_from_host(endpoint, ev.block_hashes)
                else:
                    self._removed(endpoint, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(endpoint)

    def _stored(self, endpoint: str, ev: BlockStored) -> None:
        blocks = self._endpoints.setdefault(endpoint, _EndpointBlocks())
        if ev.parent_block_hash is None:
            parent = root_key(ev.lora_id)
        else:
            found = blocks.parent_key(ev.parent_block_hash)
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
        host = ev.medium in HOST_MEDIUMS
        tier = blocks.host if host else blocks.device
        for i, engine_hash in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * size : (i + 1) * size]
            if len(tokens) < size:
                break  # only full blocks are cacheable; anything shorter is malformed
            parent = chain_key(parent, tokens)
            if engine_hash in tier.engine_to_key:
                continue  # re-announced (e.g. after replay): already counted
            tier.engine_to_key[engine_hash] = parent
            refs = tier.key_refs.get(parent, 0)
            tier.key_refs[parent] = refs + 1
            if refs == 0 and not host:
                self._holders.setdefault(parent, set()).add(endpoint)

    def _removed(self, endpoint: str, engine_hashes: Iterable[int]) -> None:
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            return
        for engine_hash in engine_hashes:
            key = blocks.device.remove(engine_hash)
            if key is None:
                continue
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self._holders[key]

    def _removed_from_host(self, endpoint: str, engine_hashes: Iterable[int]) -> None:
        blocks = self._endpoints.get(endpoint)
        if blocks is not None:
            for engine_hash in engine_hashes:
                blocks.host.remove(engine_hash)

    def clear(self, endpoint: str) -> None:
        blocks = self._endpoints.pop(endpoint, None)
        if blocks is None:
            return
        for key in blocks.device.key_refs:
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
        return len(blocks.device.key_refs) if blocks else 0

    def host_block_count(self, endpoint: str) -> int:
        """Blocks the endpoint's host tier holds (what its CPU-medium events announced)."""
        blocks = self._endpoints.get(endpoint)
        return len(blocks.host.key_refs) if blocks else 0

    def has_host_tier(self, endpoint: str) -> bool:
        blocks = self._endpoints.get(endpoint)
        return bool(blocks and blocks.host.key_refs)

    def extend_through_host(self, keys: Sequence[int], device_blocks: dict[str, int]) -> dict[str, int]:
        """Per endpoint: how far the run of ``keys`` it can serve without computing goes, given
        the ``device_blocks`` it holds on the device from the start: the engine's lookup goes
        on in its host tier where the device's run ends, and any block held in either tier
        continues it. Endpoints without a host tier keep their device count."""
        out = dict(device_blocks)
        n = len(keys)
        for endpoint, start in device_blocks.items():
            blocks = self._endpoints.get(endpoint)
            if blocks is None or start >= n or not blocks.host.key_refs:
                continue
            host, device = blocks.host.key_refs, blocks.device.key_refs
            depth = start
            while depth < n and (keys[depth] in host or keys[depth] in device):
                depth += 1
            out[endpoint] = depth
        return out

    def holders(self, key: int) -> frozenset[str]:
        return frozenset(self._holders.get(key, ()))

    def prefix_blocks(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Per endpoint: how many of ``keys``, counted from the first, it holds consecutively."""
        return _longest_prefix(keys, endpoints, self._holders.get, self._keys_of)

    def _keys_of(self, endpoint: str) -> Container[int]:
        blocks = self._endpoints.get(endpoint)
        return blocks.device.key_refs if blocks else ()


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

    def prefix_blocks(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Like ``PreciseIndex.prefix_blocks``."""
        return _longest_prefix(keys, endpoints, self._lru.get)


@dataclass(slots=True)
class _RecentPick:
    when: float
    keys: Sequence[int]
    until: float  # counts as cached there until then


class RecentPicks:
    """This replica's own picks (and those other replicas announce), to bridge the gap before an
    engine's ``BlockStored`` arrives: a burst of same-prefix requests must not scatter meanwhile.

    A pick counts for ``window_seconds``, or longer when the caller says the engine will only
    have computed the prompt later (``until``): under pressure a request waits in its engine's
    queue for many seconds, and a prefix forgotten while its first request waits gets computed
    a second time elsewhere.

    Picks are grouped by their first block key (different first keys share nothing), and only
    the newest ``per_endpoint`` picks of a group per endpoint are kept, so a query costs a few
    binary searches per endpoint however high the pick rate.

    Bounded whatever engines report: a pick counts at most ``max_hold_seconds`` (an engine
    predicting a huge pending prefill would otherwise hold every pick for that long, and memory
    would grow with the pick rate), and at most ``max_groups`` first keys are kept, the least
    recently picked going first.
    """

    def __init__(
        self,
        window_seconds: float,
        per_endpoint: int = 8,
        max_hold_seconds: float = 120.0,
        max_groups: int = 65_536,
    ) -> None:
        self.window_seconds = window_seconds
        self.per_endpoint = per_endpoint
        self.max_hold_seconds = max(max_hold_seconds, window_seconds)
        self.max_groups = max_groups
        self._groups: OrderedDict[int, dict[str, deque[_RecentPick]]] = OrderedDict()
        self._expiry: list[tuple[float, int]] = []  # heap of (until, first key)

    def record(self, keys: Sequence[int], endpoint: str, when: float, until: float | None = None) -> None:
        if not keys:
            return
        until = min(max(when + self.window_seconds, until or 0.0), when + self.max_hold_seconds)
        first = keys[0]
        group = self._groups.get(first)
        if group is None:
            group = self._groups[first] = {}
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)  # its heap entries expire as no-ops
        else:
            self._groups.move_to_end(first)
        picks = group.get(endpoint)
        if picks is None:
            picks = group[endpoint] = deque(maxlen=self.per_endpoint)
        picks.append(_RecentPick(when, keys, until))
        heapq.heappush(self._expiry, (until, first))
        if len(self._expiry) > 2 * self.max_groups + 1024:
            self._compact()

    def _compact(self) -> None:
        """One expiry entry per group (its latest pick's), instead of one per pick ever made:
        the heap stays proportional to the groups kept, not to the pick rate."""
        self._expiry = [
            (max(p.until for picks in group.values() for p in picks), first)
            for first, group in self._groups.items()
            if any(group.values())
        ]
        heapq.heapify(self._expiry)

    def __len__(self) -> int:
        """Picks held (what memory grows with)."""
        return sum(len(picks) for group in self._groups.values() for picks in group.values())

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] < now:
            _, first = heapq.heappop(expiry)
            group = self._groups.get(first)
            if group is None:
                continue
            for endpoint in [ep for ep, picks in group.items() if all(p.until < now for p in picks)]:
                del group[endpoint]
            if not group:
                del self._groups[first]

    def prefix_blocks(
        self, keys: Sequence[int], endpoints: Iterable[str], now: float, floor: dict[str, int] | None = None
    ) -> dict[str, int]:
        """Per endpoint: the most leading blocks of ``keys`` a pick still counted sent there, or its ``floor`` (what is known cached there already) when that is more."""
        self._expire(now)
        result = dict.fromkeys(endpoints, 0)
        if floor:
            for endpoint in result:
                result[endpoint] = floor.get(endpoint, 0)
        if not keys:
            return result
        group = self._groups.get(keys[0])
        if not group:
            return result
        n = len(keys)
        for endpoint, best in result.items():
            for pick in group.get(endpoint, ()):
                # Chained keys: a pick beats `best` only if it also has key number `best` (one
                # comparison; most picks share just the prompt's common opening with this one).
                if pick.until >= now and best < n and best < len(pick.keys) and pick.keys[best] == keys[best]:
                    best = common_prefix_blocks(keys, pick.keys, best + 1)
            result[endpoint] = best
        return result

    def forget_endpoint(self, endpoint: str) -> None:
        for group in self._groups.values():
            group.pop(endpoint, None)


def _longest_prefix(
    keys: Sequence[int],
    endpoints: Iterable[str],
    lookup: Callable[[int], Collection[str] | None],
    keys_of: Callable[[str], Container[int]] | None = None,
) -> dict[str, int]:
    """``lookup``: a key's holders; ``keys_of`` (optional): one endpoint's keys, for the walk
    once a single holder is left (a membership test per block, run in C)."""
    alive = set(endpoints)
    result = dict.fromkeys(alive, 0)
    depth = 0
    remaining = iter(keys)
    for key in remaining:
        holders = lookup(key)
        if not holders:
            break
        if len(alive) == 1:
            # The common case deep into a prompt: one holder left, a membership test per block.
            (only,) = alive
            if only not in holders:
                result[only] = depth
                return result
            depth += 1
            if keys_of is not None:
                depth += len(list(takewhile(keys_of(only).__contains__, remaining)))
            else:
                for key in remaining:
                    holders = lookup(key)
                    if holders is None or only not in holders:
                        break
                    depth += 1
            result[only] = depth
            return result
        if alive.issubset(holders):  # no allocation: most blocks of a shared prefix
            depth += 1
            continue
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

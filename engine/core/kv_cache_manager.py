"""Maps requests to paged KV blocks: allocation, prefix-cache lookups, freeing.

Full blocks become findable as soon as a step that computes them is scheduled
(`cache_full_blocks`), as in vLLM: a request admitted later in the same step may hit blocks
that an earlier request of the step is computing. That is sound because a runner stores the KV
of every token of a batch before any attention read in each layer (see runner_api), and it
means n > 1 samples or a burst of requests sharing a prompt compute it once, not n times.

With a host tier (`host_blocks` > 0) a lookup that runs out of device blocks goes on in the
tier; the blocks it finds there get fresh device blocks and are loaded, not computed, before
the step runs. Blocks reach the tier when the device pool evicts them (`offload_on="evict"`:
only what would be lost is copied, and the tiers hold different blocks) or as soon as a step
computes them (`"compute"`: vLLM's native offloading; every block is copied once, after the
step, and an eviction from the device costs nothing). The copies a step needs travel in its
batch (`Transfers`), for the runner to make.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvgate.api.contracts.kv_events import KVEvent
from kvgate.engine.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvgate.engine.core.host_kv_tier import HostBlock, HostKVTier
from kvgate.engine.core.request import Request

OffloadOn = Literal["evict", "compute"]
OFFLOAD_POLICIES: tuple[OffloadOn, ...] = ("evict", "compute")


class CacheHit(NamedTuple):
    """A request's prefix-cache hit, as the scheduler holds it until it hands it back to
    `allocate`: it reads the token count, never the blocks (vLLM's KVCacheBlocks).
    `num_tokens` covers both tiers: the device blocks first, then the host ones."""

    blocks: list[KVBlock]
    num_tokens: int
    host_blocks: list[HostBlock] = []  # noqa: RUF012 (never mutated: a NamedTuple default)

    def first_blocks(self, count: int, block_size: int) -> CacheHit:
        host = max(0, count - len(self.blocks))
        return CacheHit(
            self.blocks[:count], min(self.num_tokens, count * block_size), self.host_blocks[:host]
        )


@dataclass
class Transfers:
    """Copies between the tiers that one step needs, as (device block, host slot) pairs. The
    runner makes `saves` first, then `loads` (host slot -> device block), then computes the
    step, then makes `saves_after` (blocks this very step computes)."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    saves_after: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.saves_after)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        host_blocks: int = 0,
        offload_on: OffloadOn = "evict",
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        if offload_on not in OFFLOAD_POLICIES:
            raise ValueError(f"offload_on must be one of {', '.join(OFFLOAD_POLICIES)}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        events: list[KVEvent] = []
        self.host: HostKVTier | None = None
        if host_blocks > 0 and enable_caching:
            self.host = HostKVTier(host_blocks, block_size, events)
        self.offload_on: OffloadOn = offload_on
        self.pool = BlockPool(
            num_blocks,
            block_size,
            enable_caching,
            events,
            self._offload_evicted if self.host is not None and offload_on == "evict" else None,
        )
        self._transfers = Transfers()
        # Copies are only made by a step: a block the pool evicts between steps (a P/D import
        # taking room) is dropped, not offloaded, as no step would copy it before it is reused.
        self._in_step = False
        self._blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have gone through `register` already.
        self._num_registered: dict[str, int] = {}
        # Requests whose KV mixes an adapter's old weights with its new ones: their blocks are
        # never made findable (until they are freed, e.g. preempted and recomputed).
        self._uncacheable: set[str] = set()
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.host_cache_queries = 0  # tokens looked up with a host tier (vllm:external_prefix_cache_*)
        self.host_cache_hits = 0  # tokens loaded from it instead of computed

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing -------------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash every full block among the first `num_tokens` tokens that is not hashed yet."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_tokens // bs):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], request.lora_id)
            hashes.append(parent)

    # -- lookups and allocation ----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> CacheHit:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        Never the whole sequence: the last token must be computed so the model can sample.
        Has no side effects; the hit is counted when `allocate` accepts it.
        """
        if not self.enable_caching:
            return CacheHit([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        hashes = request.block_hashes[:max_blocks]
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        host_hits: list[HostBlock] = []
        if self.host is not None:
            for h in hashes[len(hits) :]:
                held = self.host.lookup(h)
                if held is None:
                    break
                host_hits.append(held)
        return CacheHit(hits, (len(hits) + len(host_hits)) * self.block_size, host_hits)

    def recomputed_tokens(self, request: Request, num_hit: int) -> int:
        """Prompt tokens the cache holds that this schedule computes anyway: a block-aligned
        prompt cached whole still computes its last block (see `get_computed_blocks`).
        vLLM reports these as `vllm:prompt_tokens_recomputed`."""
        bs = self.block_size
        if not self.enable_caching or request.num_tokens % bs or num_hit != request.num_tokens - bs:
            return 0
        self._extend_hashes(request, request.num_tokens)
        return bs if self.pool.lookup(request.block_hashes[-1]) is not None else 0

    def cached_prefix_tokens(self, token_ids: list[int], lora_id: int | None = None) -> int:
        """How many leading tokens of a prompt the cache holds now, without a Request: a read-only
        estimate other threads may take (dict lookups are atomic; a block evicted meanwhile only
        makes it stale). Like `get_computed_blocks`, never the whole prompt."""
        if not self.enable_caching:
            return 0
        bs = self.block_size
        parent = None
        hits = 0
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], lora_id)
            if self.pool.lookup(parent) is None and (self.host is None or parent not in self.host):
                break
            hits += 1
        return hits * bs

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        num_computed_hit_tokens: int = 0,
        host_blocks: list[HostBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens (after any prefix hit being accepted; its
        host blocks get the first new device blocks and are loaded into them).

        Returns the request's block ids, or None (changing nothing) when the pool is short.
        """
        computed_blocks = computed_blocks or []
        host_blocks = host_blocks or []
        blocks = self._blocks.get(request.request_id)
        if blocks is None:
            blocks = self._blocks[request.request_id] = []
            self._num_registered[request.request_id] = 0
        total = request.num_computed_tokens + num_computed_hit_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not blocks:
                del self._blocks[request.request_id]
                del self._num_registered[request.request_id]
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            request.block_ids.extend(b.block_id for b in computed_blocks)
            self._num_registered[request.request_id] = len(blocks)
        if num_new_blocks > 0:
            if host_blocks:
                # Pinned first: the evictions `take` makes may offload blocks to the host, and
                # must not take the slots these loads read.
                assert self.host is not None and num_new_blocks >= len(host_blocks)
                self.host.pin_for_load(host_blocks)
            new = self.pool.take(num_new_blocks)
            blocks.extend(new)
            request.block_ids.extend(b.block_id for b in new)
            if host_blocks:
                self._transfers.loads.extend(
                    (dst.block_id, src.slot) for src, dst in zip(host_blocks, new, strict=False)
                )
        if request.num_computed_tokens == 0 and self.enable_caching:
            host_tokens = min(num_computed_hit_tokens, len(host_blocks) * self.block_size)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_hit_tokens - host_tokens
            if self.host is not None:
                self.host_cache_queries += request.num_tokens
                self.host_cache_hits += host_tokens
            request.num_host_cached_tokens = host_tokens
        return request.block_ids

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's full blocks among its first `num_tokens` tokens findable (their
        KV is computed by the end of the step being scheduled); emits BlockStored."""
        if not self.enable_caching or request.request_id in self._uncacheable:
            return
        done = self._num_registered.get(request.request_id)
        if done is None or num_tokens < (done + 1) * self.block_size:
            return  # the common decode step: no block filled up
        blocks = self._blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(blocks))
        if num_full <= done:
            return
        self._extend_hashes(request, num_full * self.block_size)
        bs = self.block_size
        self.pool.register(
            blocks[done:num_full],
            request.block_hashes[done:num_full],
            request.block_hashes[done - 1] if done else None,
            request.all_token_ids[done * bs : num_full * bs],
            request.lora_id,
        )
        self._num_registered[request.request_id] = num_full
        if self.host is not None and self.offload_on == "compute" and self._in_step:
            for block in blocks[done:num_full]:
                if block.block_hash is not None:  # not a private duplicate
                    self._offload(block, self._transfers.saves_after)

    # -- the host tier -------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step is being scheduled: the previous one has run (its loads are done)."""
        if self.host is not None:
            self.host.unpin_all()
        self._transfers = Transfers()
        self._in_step = True

    def end_step(self) -> Transfers:
        """The copies the scheduled step needs (the runner makes them with it)."""
        self._in_step = False
        transfers, self._transfers = self._transfers, Transfers()
        return transfers

    def _offload_evicted(self, block: KVBlock) -> None:
        if self._in_step:
            self._offload(block, self._transfers.saves)

    def _offload(self, block: KVBlock, saves: list[tuple[int, int]]) -> None:
        assert self.host is not None and block.block_hash is not None
        slot = self.host.store(block.block_hash, block.parent_hash, block.token_ids, block.lora_id)
        if slot is not None:
            saves.append((block.block_id, slot))

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool; cached ones stay findable until evicted."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._uncacheable.discard(request.request_id)
        request.block_ids = []
        if blocks:
            self.pool.release(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past the first `num_tokens` tokens (speculative
        decoding allocated them for drafts it rejected). They are never findable: only full
        blocks of computed, accepted tokens are registered, and those lie before."""
        blocks = self._blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        assert self._num_registered.get(request.request_id, 0) <= keep
        extra = blocks[keep:]
        del blocks[keep:]
        del request.block_ids[keep:]
        self.pool.release(reversed(extra))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared). Requests in flight keep their blocks;
        their computed full blocks are stored again (fresh BlockStored chains from the root)
        after their next step, so later events never name a parent the subscriber dropped."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.clear()
        for rid in self._num_registered:
            self._num_registered[rid] = 0
        return True

    def forget_lora(self, lora_id: int, request_ids: Iterable[str]) -> int:
        """An adapter's weights changed: no later request may hit KV computed with the old ones.
        Every block cached under it becomes unfindable (BlockRemoved), and the given requests
        of that adapter that hold blocks now (computed with the old weights; they go on with
        the new ones) never make theirs findable. Returns how many cached blocks went."""
        for rid in request_ids:
            if rid in self._blocks:
                self._uncacheable.add(rid)
        gone = self.pool.forget_lora(lora_id)
        if self.host is not None:
            gone += self.host.forget_lora(lora_id)
        return gone

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

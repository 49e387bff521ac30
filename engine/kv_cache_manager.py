"""Maps requests to paged KV blocks: allocation, prefix-cache lookups, freeing.

Full blocks become findable as soon as a step that computes them is scheduled
(`cache_full_blocks`), as in vLLM: a request admitted later in the same step may hit blocks
that an earlier request of the step is computing. That is sound because a runner stores the KV
of every token of a batch before any attention read in each layer (see runner_api), and it
means n > 1 samples or a burst of requests sharing a prompt compute it once, not n times.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvgate.api.contracts.kv_events import KVEvent
from kvgate.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvgate.engine.request import Request


class CacheHit(NamedTuple):
    """A request's prefix-cache hit, as the scheduler holds it until it hands it back to
    `allocate`: it reads the token count, never the blocks (vLLM's KVCacheBlocks)."""

    blocks: list[KVBlock]
    num_tokens: int

    def first_blocks(self, count: int, block_size: int) -> CacheHit:
        return CacheHit(self.blocks[:count], min(self.num_tokens, count * block_size))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have gone through `register` already.
        self._num_registered: dict[str, int] = {}
        # Requests whose KV mixes an adapter's old weights with its new ones: their blocks are
        # never made findable (until they are freed, e.g. preempted and recomputed).
        self._uncacheable: set[str] = set()
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

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
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return CacheHit(hits, len(hits) * self.block_size)

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
            if self.pool.lookup(parent) is None:
                break
            hits += 1
        return hits * bs

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        num_computed_hit_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens (after any prefix hit being accepted).

        Returns the request's block ids, or None (changing nothing) when the pool is short.
        """
        computed_blocks = computed_blocks or []
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
            new = self.pool.take(num_new_blocks)
            blocks.extend(new)
            request.block_ids.extend(b.block_id for b in new)
        if request.num_computed_tokens == 0 and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_hit_tokens
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

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool; cached ones stay findable until evicted."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._uncacheable.discard(request.request_id)
        request.block_ids = []
        if blocks:
            self.pool.release(reversed(blocks))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared). Requests in flight keep their blocks;
        their computed full blocks are stored again (fresh BlockStored chains from the root)
        after their next step, so later events never name a parent the subscriber dropped."""
        self.pool.reset_prefix_cache()
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
        return self.pool.forget_lora(lora_id)

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

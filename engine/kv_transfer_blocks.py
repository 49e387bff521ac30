"""Prefill/decode disaggregation, the engine-thread half: pinning a prompt's cached blocks for a
pull (producer), and taking pulled blocks into the prefix cache (consumer).

Blocks are named by their prefix-cache hash chain (`hash_block_tokens`), never by position, so a
consumer takes only the blocks whose hashes equal the ones its own tokenization of the prompt
gives: a prompt the two engines tokenized differently, another adapter, or another block size
simply matches less, and the rest is computed locally. Everything here runs on the engine
thread, between steps (`AsyncEngine.call`); moving the bytes happens outside it, in the server
half (`kvgate.engine.server.kv_transfer_http`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgate.engine.core.block_pool import KVBlock, hash_block_tokens

if TYPE_CHECKING:
    from kvgate.engine.llm_engine import LLMEngine


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, lora_id: int | None) -> list[int]:
    """The hash of each full block of a prompt, as the prefix cache chains them."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], lora_id)
        hashes.append(parent)
    return hashes


@dataclass
class Pin:
    """Blocks held by a transfer (a reference each), so no step evicts them meanwhile."""

    blocks: list[KVBlock] = field(default_factory=list)
    released: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def pin_cached_prefix(engine: LLMEngine, hashes: Sequence[int]) -> Pin:
    """Producer: hold the longest prefix of these blocks the cache still has."""
    pool = engine.kv.pool
    found: list[KVBlock] = []
    for h in hashes:
        block = pool.lookup(h)
        if block is None:
            break
        found.append(block)
    pool.touch(found)
    return Pin(found)


def release(engine: LLMEngine, pin: Pin) -> None:
    if pin.released:
        return
    pin.released = True
    engine.kv.pool.release(reversed(pin.blocks))


@dataclass
class ImportPlan:
    """Consumer: a block per expected hash, in prefix order. `fresh[i]`: the data must arrive
    for block i (False: this engine already caches it, the bytes are skipped)."""

    hashes: list[int]
    pin: Pin
    fresh: list[bool]

    @property
    def block_ids(self) -> list[int]:
        return self.pin.block_ids


def reserve_import(engine: LLMEngine, hashes: Sequence[int], max_share: float = 0.5) -> ImportPlan:
    """Take a block for each hash (a cached one where this engine has it): held, not yet
    findable. Never more than `max_share` of the pool's free blocks: a transfer must not
    starve the requests this engine is running; what does not fit is computed locally."""
    pool = engine.kv.pool
    blocks: list[KVBlock] = []
    fresh: list[bool] = []
    budget = int(pool.num_free_blocks * max_share)
    kept: list[int] = []
    for h in hashes:
        cached = pool.lookup(h)
        if cached is not None:
            pool.touch([cached])
            blocks.append(cached)
            fresh.append(False)
        else:
            if budget <= 0:
                break
            budget -= 1
            blocks.extend(pool.take(1))
            fresh.append(True)
        kept.append(h)
    return ImportPlan(kept, Pin(blocks), fresh)


def commit_import(
    engine: LLMEngine, plan: ImportPlan, verified: int, token_ids: Sequence[int], lora_id: int | None
) -> int:
    """The first `verified` blocks hold their data: make them findable by hash (BlockStored
    events go out with the next step's), give back the others. Returns the blocks kept."""
    pool = engine.kv.pool
    bs = engine.block_size
    keep = plan.pin.blocks[:verified]
    drop = plan.pin.blocks[verified:]
    if drop:
        pool.release(reversed(drop))
    plan.pin.blocks = keep
    if keep:
        pool.register(keep, plan.hashes[:verified], None, token_ids[: verified * bs], lora_id)
    return len(keep)


def runner_kv_layout(engine: LLMEngine) -> dict[str, Any] | None:
    """How the runner lays out one block's KV (None: it cannot move blocks)."""
    return engine.kv_runner.kv_layout() if engine.kv_runner is not None else None

"""The `prefix-cache-scorer` scorer (PrefixCacheScorer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.prefix_index import ApproximateIndex, root_key
from kvgate.epp.scheduling.framework import EndpointForgetter, PreRequest, SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


@register
@dataclass
class PrefixCacheScorer:
    """GIE's approximate prefix scorer: prompt text hashed in character blocks, remembered per
    endpoint when this EPP routes there. Needs no tokenizer and no engine cooperation."""

    type_name: ClassVar[str] = "prefix-cache-scorer"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
    name: str = type_name
    block_size: int = 64  # characters
    max_prefix_blocks: int = 256
    lru_capacity: int = 200_000
    index: ApproximateIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = ApproximateIndex(self.lru_capacity)

    def _keys(self, ctx: SchedulingContext) -> list[int]:
        cache_key = f"{self.name}:keys"
        keys = ctx.cache.get(cache_key)
        if keys is None:
            text = ctx.request.prompt_text
            parent = hash((root_key(None), ctx.request.target_model))
            keys = []
            size = self.block_size
            for start in range(0, min(len(text), size * self.max_prefix_blocks) - size + 1, size):
                parent = hash((parent, text[start : start + size]))
                keys.append(parent)
            ctx.cache[cache_key] = keys
        return keys

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[float]:
        keys = self._keys(ctx)
        if not keys:
            return [0.0] * len(endpoints)
        hits = self.index.prefix_blocks(keys, [e.address for e in endpoints])
        n = len(keys)
        return [hits[e.address] / n for e in endpoints]

    def pre_request(self, ctx: SchedulingContext, target: EndpointState) -> None:
        self.index.record(self._keys(ctx), target.address)

    def forget_endpoint(self, address: str) -> None:
        """The endpoint left the pool: a new pod on the same ip:port must not inherit its prefixes."""
        self.index.forget_endpoint(address)


if TYPE_CHECKING:  # mypy holds the scorer to the contracts the profile resolves on it
    _contracts: tuple[type[EndpointForgetter], type[PreRequest]] = (PrefixCacheScorer, PrefixCacheScorer)

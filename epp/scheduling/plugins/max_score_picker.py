"""The `max-score-picker` picker (MaxScorePicker)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register


def tie_breaker(ctx: SchedulingContext) -> Callable[[str], int]:
    """A per-request ranking of endpoints (rendezvous hashing on the prompt's opening).

    Equal scores are common (a new prefix nobody holds, an idle pool). Breaking them by a hash
    of the prompt's start and the endpoint, rather than at random, spreads different prompts
    evenly as random would, but sends the same prefix to the same engine from every EPP
    replica: active-active replicas agree, and a new system prompt arriving at two replicas at
    once lands in one cache instead of two. A fixed hash, not hash(): str hashes differ per process.
    """
    req = ctx.request
    key = (req.prompt_text[:TIE_KEY_CHARS] if req.body else req.request_id).encode("utf-8", "replace")
    # A keyed blake2b per endpoint, not crc32(address, seed): crc32 is affine in its seed, so
    # prompts that differ by a character ranked the endpoints alike, and an idle pool sent
    # two thirds of such prompt families all to one engine.
    seed = hashlib.blake2b(key, digest_size=16).digest()
    return lambda address: int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8, key=seed).digest())


TIE_KEY_CHARS = 512


@register
@dataclass
class MaxScorePicker:
    """Highest score wins; ties broken by rendezvous hashing on the prompt (see tie_breaker)."""

    type_name: ClassVar[str] = "max-score-picker"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
    name: str = type_name
    max_num_of_endpoints: int = 1

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        if not endpoints:
            return []
        if self.max_num_of_endpoints == 1:
            # The usual case: the tie-break hash (a blake2b per endpoint) only among the best.
            best = max(scores)
            tied = [i for i, s in enumerate(scores) if s == best]
            if len(tied) == 1:
                return [endpoints[tied[0]]]
            if tied:  # else NaN scores (nothing equals them): the full ranking below decides
                rank = tie_breaker(ctx)
                return [endpoints[min(tied, key=lambda i: rank(endpoints[i].address))]]
        rank = tie_breaker(ctx)
        order = sorted(range(len(endpoints)), key=lambda i: (-scores[i], rank(endpoints[i].address)))
        return [endpoints[i] for i in order[: self.max_num_of_endpoints]]

"""Pickers: weighted scores in, the chosen endpoint (then fallbacks) out."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext


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


@dataclass
class MaxScorePicker:
    """Highest score wins; ties broken by rendezvous hashing on the prompt (see tie_breaker)."""

    type_name: ClassVar[str] = "max-score-picker"
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


@dataclass
class RandomPicker:
    type_name: ClassVar[str] = "random-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        return self.rng.sample(endpoints, min(self.max_num_of_endpoints, len(endpoints)))


@dataclass
class WeightedRandomPicker:
    """Chooses with probability proportional to score (uniform when every score is 0)."""

    type_name: ClassVar[str] = "weighted-random-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        remaining = list(range(len(endpoints)))
        chosen: list[EndpointState] = []
        while remaining and len(chosen) < self.max_num_of_endpoints:
            weights = [scores[i] for i in remaining]
            if sum(weights) <= 0:
                i = self.rng.choice(remaining)
            else:
                i = self.rng.choices(remaining, weights=weights)[0]
            remaining.remove(i)
            chosen.append(endpoints[i])
        return chosen


@dataclass
class RoundRobinPicker:
    """Cycles through the candidates in address order, ignoring scores (a baseline)."""

    type_name: ClassVar[str] = "round-robin-picker"
    name: str = type_name
    max_num_of_endpoints: int = 1
    _next: int = 0

    def pick(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], scores: list[float]
    ) -> list[EndpointState]:
        if not endpoints:
            return []
        ordered = sorted(endpoints, key=lambda e: e.address)
        start = self._next % len(ordered)
        self._next += 1
        rotated = ordered[start:] + ordered[:start]
        return rotated[: self.max_num_of_endpoints]

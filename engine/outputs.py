"""What the engine hands back, step by step (server) or at the end (offline `LLM`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    decoded: str


@dataclass
class PositionLogprobs:
    """Logprobs at one generated position: the sampled token plus the top-N alternatives."""

    sampled: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class PromptTokenLogprobs:
    """Logprobs at one prompt position (from the second token on): the actual prompt token with
    its rank in the vocabulary, and the top-K alternatives (ranks 1..K)."""

    token: TokenLogprob
    rank: int
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    """State of one engine request after a step. Cumulative fields and per-step deltas."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    token_ids: list[int]  # every generated token so far
    text: str  # detokenized output so far (stop string removed unless asked to keep it)
    new_token_ids: list[int]  # generated this step
    delta_text: str  # text added this step
    logprobs: list[PositionLogprobs] | None = None  # cumulative, when requested
    new_logprobs: list[PositionLogprobs] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # wall clock, like the other timestamps
    first_token_time: float | None = None
    finished_time: float | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when requested
    # Prompt tokens the prefix cache held but the first schedule computed again (a fully cached,
    # block-aligned prompt recomputes its last block so the model has a position to sample from).
    num_recomputed_tokens: int = 0
    num_host_cached_tokens: int = 0  # of num_cached_tokens, those loaded from the host KV tier
    # Speculative decoding, so far: verification steps with drafts, draft tokens verified, and
    # of those accepted (before a stop truncated a step). None: the engine does not speculate.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    # Prompt logprobs (first output only, when asked): None for the first prompt token, then one
    # entry per later prompt token, as vLLM returns them.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None

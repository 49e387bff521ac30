"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.structured.spec import StructuredOutputSpec


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    skip_special_tokens: bool = True
    # Top-K logprobs at each prompt position after the first (vLLM's extension); the prompt
    # token itself is always included. Computed in the prefill forward pass, never from cache.
    prompt_logprobs: int | None = None
    # Guided decoding: the output must match this (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputSpec | None = None

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be non-negative")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

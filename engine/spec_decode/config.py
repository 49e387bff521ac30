"""`--speculative-config`: vLLM's JSON; the `ngram` and `draft_model` methods are implemented."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # a verification step is a chunk of 1 + k tokens per sequence


class SpeculativeConfigError(ValueError):
    """The JSON does not describe a speculative setting this engine implements."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Propose up to `num_speculative_tokens` tokens. `ngram` (vLLM's method): from the sequence
    itself, the tokens that followed the most recent earlier occurrence of its last n tokens,
    for the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that occurs.
    `draft_model`: a smaller model of the same vocabulary, run greedily for k tokens on its own
    paged KV cache (spec_decode/draft_model.py).

    `adaptive` (kvgate's key, default true): each step a request takes only the drafts its
    measured acceptance and the device's measured step cost say pay (spec_decode/adaptive.py),
    0 to `num_speculative_tokens`; false: always all the proposal gives (vLLM's behaviour)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    adaptive: bool = True
    # draft_model: the draft (a path or Hub id, vLLM's `model`; None: the target model itself),
    # and kvgate's `draft_num_layers`: only its first N decoder layers (then its final norm and
    # lm head), e.g. a truncated copy of the target. Drafts are the draft's greedy tokens.
    model: str | None = None
    draft_num_layers: int | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        known = {
            "adaptive",
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "model",
            "draft_num_layers",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        method = raw.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"--speculative-config: method {method!r} is not supported (only {', '.join(METHODS)})"
            )
        if "num_speculative_tokens" not in raw:
            raise SpeculativeConfigError("--speculative-config: num_speculative_tokens is required")
        k = _int(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise SpeculativeConfigError(
                f"--speculative-config: adaptive must be true or false, got {adaptive!r}"
            )
        if method == "draft_model":
            lookup = sorted(set(raw) & {"prompt_lookup_max", "prompt_lookup_min"})
            if lookup:
                raise SpeculativeConfigError(
                    f"--speculative-config: {', '.join(lookup)} is for the ngram method, not draft_model"
                )
            model = raw.get("model")
            if model is not None and (not isinstance(model, str) or not model.strip()):
                raise SpeculativeConfigError(
                    f"--speculative-config: model must be a path or Hub id, got {model!r}"
                )
            layers = _int(raw, "draft_num_layers", 1, 1024) if "draft_num_layers" in raw else None
            return cls(
                num_speculative_tokens=k,
                method=method,
                adaptive=adaptive,
                model=model,
                draft_num_layers=layers,
            )
        extra = sorted(set(raw) & {"model", "draft_num_layers"})
        if extra:
            raise SpeculativeConfigError(
                f"--speculative-config: {', '.join(extra)} is for the draft_model method, not ngram"
            )
        # As vLLM: one bound given, the other equals it; neither, both 5.
        hi = raw.get("prompt_lookup_max", raw.get("prompt_lookup_min", 5))
        lo = raw.get("prompt_lookup_min", raw.get("prompt_lookup_max", 5))
        lo = _int({"prompt_lookup_min": lo}, "prompt_lookup_min", 1, 1024)
        hi = _int({"prompt_lookup_max": hi}, "prompt_lookup_max", 1, 1024)
        if lo > hi:
            raise SpeculativeConfigError(
                f"--speculative-config: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}"
            )
        return cls(
            num_speculative_tokens=k,
            prompt_lookup_max=hi,
            prompt_lookup_min=lo,
            method=method,
            adaptive=adaptive,
        )


def _int(raw: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpeculativeConfigError(
            f"--speculative-config: {key} must be an integer in [{lo}, {hi}], got {value!r}"
        )
    return value

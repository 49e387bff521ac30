"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvgate.engine.config import DEFAULT_MODEL, EngineConfig
from kvgate.engine.core.runner_api import ModelRunner
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import FinishReason, PositionLogprobs, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

# A string, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [int]}.
PromptInput = str | list[int] | dict[str, Any]


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionRequestOutput:
    """All sequences for one prompt (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: None = None  # vLLM's field; prompt logprobs are not computed here

    @property
    def finished(self) -> bool:
        return all(o.finished() for o in self.outputs)


def sample_seed(seed: int | None, index: int) -> int | None:
    """Seed of sample `index` of an n > 1 request: distinct per sample, reproducible from `seed`."""
    if seed is None:
        return None
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # keep it a non-negative int64


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
        **engine_config: Any,
    ) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_config) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        self.config = EngineConfig(model=model, **engine_config)
        self.engine = LLMEngine(self.config, runner=runner, tokenizer=tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionRequestOutput]:
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        tokenized: list[tuple[str | None, list[int]]] = []
        for text, ids in items:
            if ids is None:
                assert text is not None
                ids = self._encode(text, add_special_tokens=True)
            tokenized.append((text, ids))
        return self._run(tokenized, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[CompletionRequestOutput]:
        if not messages:
            return []
        conversations: list[list[dict[str, Any]]]
        if isinstance(messages[0], dict):
            conversations = [cast("list[dict[str, Any]]", messages)]  # one conversation
        else:
            conversations = [list(c) for c in cast("Sequence[list[dict[str, Any]]]", messages)]
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            for c in conversations
        ]
        params = self._normalize_params(sampling_params, len(prompts))
        # The template already writes any BOS it wants.
        tokenized = [(p, self._encode(p, add_special_tokens=False)) for p in prompts]
        return self._run(tokenized, params, use_tqdm)

    # -- internals -----------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @staticmethod
    def _normalize_prompts(prompts: str | Sequence[PromptInput]) -> list[tuple[str | None, list[int] | None]]:
        if isinstance(prompts, str):
            return [(prompts, None)]
        if prompts and isinstance(prompts[0], int):
            raise TypeError("pass token-id prompts as a list of lists: [[1, 2, 3]]")
        out: list[tuple[str | None, list[int] | None]] = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, None))
            elif isinstance(p, list | tuple) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            elif isinstance(p, dict) and isinstance(p.get("prompt_token_ids"), list | tuple):
                out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
            elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
                out.append((p["prompt"], None))
            else:
                raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
        return out

    @staticmethod
    def _normalize_params(
        params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            params.validate()
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        for p in params:
            p.validate()
        return list(params)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[CompletionRequestOutput]:
        engine = self.engine
        results: list[CompletionRequestOutput] = []
        # engine request id -> (prompt index, sample index)
        owners: dict[str, tuple[int, int]] = {}
        added: list[str] = []
        try:
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True)):
                rid = str(next(self._ids))
                results.append(CompletionRequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids))
                for j in range(p.n):
                    sub = dataclasses.replace(p, n=1, seed=sample_seed(p.seed, j))
                    sub_id = rid if p.n == 1 else f"{rid}-{j}"
                    engine.add_request(sub_id, ids, sub)
                    added.append(sub_id)
                    owners[sub_id] = (i, j)
                results[-1].outputs = [None] * p.n  # type: ignore[list-item]
            self._drive(owners, results, use_tqdm)
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
            raise
        return results

    def _drive(
        self,
        owners: dict[str, tuple[int, int]],
        results: list[CompletionRequestOutput],
        use_tqdm: bool,
    ) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(owners), desc="Processed prompts", unit="seq")
        remaining = len(owners)
        try:
            while remaining:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine dropped requests it never finished")
                for out in self.engine.step():
                    if not out.finished or out.request_id not in owners:
                        continue
                    i, j = owners[out.request_id]
                    results[i].outputs[j] = _completion(j, out)
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, out.num_cached_tokens)
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()


def _completion(index: int, out: RequestOutput) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=out.text,
        token_ids=out.token_ids,
        cumulative_logprob=out.cumulative_logprob,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )

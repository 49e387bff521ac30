"""The OpenAI completions endpoint (POST /v1/completions) over the shared `OpenAIServing`.

What only completions have: prompts as text, token ids or lists of either (several prompts x n
choices in one request), echo (the prompt returned before, or with max_tokens 0 instead of, the
completion, with its logprobs), suffix refused, and the text_completion body and chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from kvgate.api.contracts.admissions import Pick
from kvgate.api.contracts.queue_order import QueueOrder
from kvgate.api.tracing import NO_SPAN, Span
from kvgate.engine.outputs import PositionLogprobs, RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.async_engine import RequestHandle
from kvgate.engine.server.errors import bad_request
from kvgate.engine.server.pd_handoff import Handoff
from kvgate.engine.server.protocol import CompletionRequest
from kvgate.engine.server.responses import (
    ResponseMeta,
    completion_logprobs,
    echo_completion_logprobs,
    prompt_logprobs_json,
)
from kvgate.engine.server.serving import (
    INLINE_PROMPT_CHARS,
    MAX_SEQUENCES_PER_REQUEST,
    OpenAIServing,
    Receive,
    StreamResult,
    check_prompt_logprobs,
    include_usage,
    sse_stream,
)


class OpenAIServingCompletion:
    """POST /v1/completions."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def completions(
        self,
        req: CompletionRequest,
        receive: Receive,
        pick: Pick | None = None,
        handoff: Handoff | None = None,
        order: QueueOrder | None = None,
        span: Span = NO_SPAN,
    ) -> dict[str, Any] | StreamResult:
        serving = self.serving
        model, produce = serving.prologue(req)
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        check_prompt_logprobs(req)
        structured = await serving.structured_outputs(req)
        # OpenAI and vLLM: echo with max_tokens 0 scores the prompt and returns it alone (vLLM
        # runs one token and drops it); without echo, 0 is out of range.
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1, got 0.", "max_tokens")
        echo_only = req.echo and req.max_tokens == 0
        prompt_lp = req.prompt_logprobs
        if prompt_lp is None and req.echo:
            prompt_lp = req.logprobs  # echo + logprobs: the prompt's too (None: not asked)
        p = req.prompt
        chars = len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str)) if p else 0
        if chars > INLINE_PROMPT_CHARS:
            prompts = await asyncio.to_thread(serving.completion_prompts, req)
        else:
            prompts = serving.completion_prompts(req)
        if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"{len(prompts)} prompts x n={req.n} is more than {MAX_SEQUENCES_PER_REQUEST} sequences in one request.",
                "prompt",
            )
        items: list[tuple[list[int], SamplingParams]] = []
        for ids in prompts:
            max_tokens = serving.check_prompt(ids, 1 if echo_only else req.max_tokens, "prompt")
            items.extend(
                (ids, p)
                for p in serving.sampling_params(req, max_tokens, req.logprobs, prompt_lp, structured)
            )
        echo = [serving.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        scoring = _Echo(prompts, echo_only, serving.first_token_text) if req.echo else None
        sub = await serving.submit("cmpl", req, model, prompts, items, handoff, pick, order, span)
        if req.stream:
            return sub.stream(
                self._stream(
                    sub.handle, sub.meta, include_usage(req), req.logprobs is not None, echo, receive, scoring
                )
            )
        finals = await sub.collect(receive)
        choices = []
        for index in range(len(items)):
            out = finals[index]
            generated = "" if echo_only else out.text
            text = generated if echo is None else echo[index // req.n] + generated
            lp = None
            if req.logprobs is not None:
                if scoring is not None:
                    lp = scoring.logprobs(index // req.n, out, None if echo_only else out.logprobs)
                else:
                    lp = completion_logprobs(out.logprobs, 0)
            c: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if req.prompt_logprobs is not None:
                c["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs or [])
            choices.append(c)
        body = {
            "id": sub.meta.rid,
            "object": "text_completion",
            "created": sub.meta.created,
            "model": model,
            "choices": choices,
            "usage": sub.meta.usage(finals),
        }
        if produce:
            body["kv_transfer_params"] = await sub.pin_for_pull(prompts[0])
        return body

    def _stream(
        self,
        handle: RequestHandle,
        meta: ResponseMeta,
        include_usage: bool,
        want_logprobs: bool,
        echo: list[str] | None,
        receive: Receive,
        scoring: _Echo | None = None,
    ) -> AsyncGenerator[bytes, None]:
        offsets: dict[int, int] = {}  # per choice that has started: its text offset (logprobs)
        echo_only = scoring is not None and scoring.echo_only

        def choice(index: int, out: RequestOutput) -> dict[str, Any] | None:
            text = "" if echo_only else out.delta_text
            first = index not in offsets
            if echo is not None and first:
                text = echo[index // meta.n] + text
            chunk_lp = None
            if want_logprobs:
                new_lp = None if echo_only else (out.new_logprobs or [])
                if scoring is not None and first:
                    chunk_lp = scoring.logprobs(index // meta.n, out, new_lp)
                    offsets[index] = sum(len(t) for t in chunk_lp["tokens"])
                else:
                    chunk_lp = completion_logprobs(new_lp, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(p.sampled.decoded) for p in new_lp or [])
            else:
                offsets.setdefault(index, 0)
            if not text and not out.finished and not chunk_lp:
                return None
            return {
                "index": index,
                "text": text,
                "logprobs": chunk_lp,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }

        return sse_stream(handle, meta, "text_completion", include_usage, receive, choice)


@dataclass
class _Echo:
    """Completions with echo: what the logprobs of each prompt's choices start with."""

    prompts: list[list[int]]
    echo_only: bool  # max_tokens 0: the prompt alone, the one token run to get there dropped
    first_token_text: Callable[[int], str]

    def logprobs(
        self, prompt_index: int, out: RequestOutput, generated: list[PositionLogprobs] | None
    ) -> dict[str, Any]:
        first = self.first_token_text(self.prompts[prompt_index][0])
        return echo_completion_logprobs(out.prompt_logprobs or [None], first, generated)

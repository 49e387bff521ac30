"""OpenAI completions and chat completions on top of `AsyncEngine`.

Turns a validated request into prompt token ids and one `SamplingParams` per choice (n > 1 fans
out into n engine requests with seeds seed, seed+1, ...), then either collects the finished
choices (non-streaming) or yields SSE chunks as the engine produces tokens. Response bodies
are plain dicts serialized with `json.dumps`, which keeps per-token overhead small.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from kvgate.api.lora import lora_int_id
from kvgate.engine.outputs import PositionLogprobs, PromptTokenLogprobs, RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.async_engine import AsyncEngine, EngineDeadError, RequestHandle
from kvgate.engine.server.errors import APIError, bad_request
from kvgate.engine.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvgate.engine.server.responses import (
    SSE_DONE,
    ResponseMeta,
    chat_logprobs,
    completion_logprobs,
    echo_completion_logprobs,
    prompt_logprobs_json,
    sse,
    stream_error,
)
from kvgate.engine.server.tools.request import ToolOptions, ToolPlan, plan_tools
from kvgate.engine.server.tools.stream import ToolStreamer, message_tool_calls
from kvgate.engine.structured import StructuredOutputError, StructuredOutputSpec

if TYPE_CHECKING:
    from kvgate.engine.server.kv_transfer import Imported, KVTransfer

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


@dataclass
class StreamResult:
    """An SSE body plus the hook that aborts its request if the body is never (fully) sent."""

    body: AsyncGenerator[bytes, None]
    close: Callable[[], None]


class ClientGone(Exception):
    """The HTTP client disconnected; stop work for it."""


MAX_SEQUENCES_PER_REQUEST = 1024  # prompts x n: one request must not flood the engine


@dataclass
class ModelInfo:
    served_names: list[str]
    root: str
    max_model_len: int
    vocab_size: int
    created: int
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> path
    # Unloaded adapters in their grace period: no longer listed (routers stop sending), still
    # served (requests a router sent before it noticed land); name -> path.
    retiring: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_names[0]


def _unknown_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


async def watch_disconnect(receive: Receive, handle: RequestHandle) -> None:
    """Wake the handler (via its queue) as soon as the client goes away, even while it waits."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.queue.put_nowait(ClientGone())
            return


# Prompts longer than this (characters) are templated and tokenized in a worker thread, so one
# large request never stalls the event loop that streams everyone else's tokens.
INLINE_PROMPT_CHARS = 32_768


@dataclass(frozen=True)
class Handoff:
    """What a prefill/decode hand-off needs of the HTTP request: the route and body to send the
    prefiller, the prefiller the EPP chose (x-prefiller-host-port), the caller's credentials."""

    path: str
    raw_body: bytes
    prefiller: str | None = None
    authorization: str | None = None


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        model: ModelInfo,
        trust_request_chat_template: bool = False,
        tool_options: ToolOptions | None = None,
        kv_transfer: KVTransfer | None = None,
    ) -> None:
        self.engine = engine
        self.kv = kv_transfer
        self.tokenizer = tokenizer
        self.model = model
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_options = tool_options or ToolOptions()
        # Unique ids without a getrandom syscall per request (a GIL hand-off while the engine
        # thread is busy): a random per-process prefix plus a counter.
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()

    def _first_token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):08x}"

    def _lora_id(self, model: str) -> int | None:
        # the adapter's stable id keys its prefix-cache blocks and KV events (the EPP hashes alike)
        if model in self.model.adapters or model in self.model.retiring:
            return lora_int_id(model)
        return None

    async def _submit(
        self,
        rid: str,
        items: list[tuple[list[int], SamplingParams]],
        model: str,
        lora_id: int | None,
        picked_by: str | None,
    ) -> RequestHandle:
        try:
            return await self.engine.submit(rid, items, lora_id=lora_id, picked_by=picked_by)
        except APIError as exc:
            if exc.code == "model_not_found":  # its adapter went between check_model and the engine
                raise _unknown_model(model) from None
            raise

    # ---- validation shared by both endpoints ----------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model.served_names:
            return self.model.name
        if name in self.model.adapters or name in self.model.retiring:
            return name
        raise _unknown_model(name)

    def _reject_unsupported(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (beam/best-of search is not supported).", "best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported by this engine; omit it or send 0.", name)
        if req.repetition_penalty not in (None, 1.0):
            raise bad_request(
                "repetition_penalty is not supported by this engine; omit it or send 1.", "repetition_penalty"
            )
        if req.logit_bias:
            raise bad_request("logit_bias is not supported by this engine.", "logit_bias")

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int | None:
        """Validate a tokenized prompt; return the max_tokens to use.

        An unset max_tokens stays unset: the engine stops the request at the context limit, and
        a simulated model may end it earlier with EOS the way a real one would.
        """
        limit = self.model.max_model_len
        if not ids:
            raise bad_request("The prompt is empty; send at least one token.", param)
        if len(ids) >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(ids)} tokens, which leaves no room for a completion. Please reduce the length "
                "of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return None
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def check_text_fits(self, text: str, param: str) -> None:
        """Refuse text that cannot fit the context from its length alone, before tokenizing it
        (tokenizing 10 MB costs seconds and a gigabyte)."""
        from kvgate.api.prompt import surely_too_long

        limit = self.model.max_model_len
        if n := surely_too_long(self.tokenizer, text, limit):
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"at least {n} tokens ({len(text)} characters). Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.model.vocab_size
        if ids and max(ids) >= vocab:
            raise bad_request(
                f"Token id {max(ids)} is out of range: the vocabulary has {vocab} tokens.", param
            )

    def _params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputSpec | None = None,
    ) -> list[SamplingParams]:
        base = SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
        )
        try:
            base.validate()
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        if max_tokens is not None and base.min_tokens > max_tokens:
            raise bad_request("min_tokens must not exceed max_tokens.", "min_tokens")
        if req.n == 1:
            return [base]
        # Each choice gets its own seed so choices differ yet stay reproducible (vLLM does the same).
        return [replace(base, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]

    async def _structured(
        self, req: CompletionRequest | ChatCompletionRequest, tool_schema: dict[str, Any] | None = None
    ) -> StructuredOutputSpec | None:
        """The request's output constraint, compiled (a 400 before anything is queued when it
        cannot be used). A required or named tool_choice constrains to its calls' schema."""
        spec = req.structured_spec()
        if tool_schema is not None:
            if spec is not None:
                raise bad_request(
                    "A required or named tool_choice cannot be combined with another structured "
                    "output constraint.",
                    "tool_choice",
                )
            try:
                spec = StructuredOutputSpec.json_schema(tool_schema)
                await self.engine.compile_structured(spec)
            except StructuredOutputError as exc:
                raise bad_request(
                    f"The tools' parameters cannot constrain decoding: {exc}", "tools"
                ) from None
            return spec
        if spec is not None:
            param = "response_format" if req.response_format is not None else None
            try:
                await self.engine.compile_structured(spec)
            except StructuredOutputError as exc:
                raise bad_request(str(exc), exc.param or param) from None
        return spec

    # ---- prompts ---------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            texts: list[str] | None = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = [x for x in p if isinstance(x, str)]  # all of them
        else:
            texts = None
        if texts is not None:
            if not texts:
                raise bad_request("The prompt list is empty.", "prompt")
            for t in texts:
                self.check_text_fits(t, "prompt")
            return [self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens) for t in texts]
        if not p:
            raise bad_request("The prompt is empty; send at least one token.", "prompt")
        if isinstance(p[0], int):
            prompts = [cast("list[int]", list(p))]  # validated: all token ids, or all lists of them
        else:
            prompts = [list(x) for x in cast("list[list[int]]", p)]
        for ids in prompts:
            self.check_token_ids(ids, "prompt")
        return prompts

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        request_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        from kvgate.api.prompt import (
            ChatTemplateError,
            RequestTemplateNotAllowed,
            chat_prompt_text,
            template_message,
            template_tools,
        )

        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true.",
                "continue_final_message",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message.", "messages")
        try:
            convo = [template_message(m.model_dump(exclude_none=True)) for m in messages]
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        self.check_text_fits("".join(m["content"] for m in convo), "messages")
        try:
            text = chat_prompt_text(
                self.tokenizer,
                convo,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
                request_template=request_template,
                trust_request_template=self.trust_request_chat_template,
                tools=template_tools(tools),
            )
        except RequestTemplateNotAllowed as exc:
            raise APIError(400, str(exc), param="chat_template", code="chat_template_not_allowed") from None
        except ChatTemplateError as exc:
            raise bad_request(f"Cannot apply the chat template: {exc}", "messages") from None
        self.check_text_fits(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def chat_prompt_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        chat_template: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """`chat_prompt` for a request (chat completions, /tokenize): the request's own template
        follows --trust-request-chat-template, and slow work runs off the event loop."""
        from kvgate.api.chat_template import ChatTemplateError, request_chat_template

        try:
            template = request_chat_template(
                {"chat_template": chat_template, "chat_template_kwargs": template_kwargs}
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "chat_template") from None
        args = (messages, add_generation_prompt, continue_final_message, template_kwargs, template, tools)
        if template is not None and self.trust_request_chat_template:
            return await asyncio.to_thread(self.chat_prompt, *args)  # waits on a child process
        if sum(len(m.text()) for m in messages) > INLINE_PROMPT_CHARS:
            return await asyncio.to_thread(self.chat_prompt, *args)
        return self.chat_prompt(*args)

    # ---- completions -----------------------------------------------------------------------
    async def completions(
        self,
        req: CompletionRequest,
        receive: Receive,
        picked_by: str | None = None,
        handoff: Handoff | None = None,
    ) -> dict[str, Any] | StreamResult:
        model = self.check_model(req.model)
        self._reject_unsupported(req)
        produce = self._produces(req)
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        _check_prompt_logprobs(req)
        structured = await self._structured(req)
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
            prompts = await asyncio.to_thread(self.completion_prompts, req)
        else:
            prompts = self.completion_prompts(req)
        if len(prompts) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"{len(prompts)} prompts x n={req.n} is more than {MAX_SEQUENCES_PER_REQUEST} sequences in one request.",
                "prompt",
            )
        items: list[tuple[list[int], SamplingParams]] = []
        for ids in prompts:
            max_tokens = self._check_prompt(ids, 1 if echo_only else req.max_tokens, "prompt")
            items.extend((ids, p) for p in self._params(req, max_tokens, req.logprobs, prompt_lp, structured))
        echo = [self.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        scoring = _Echo(prompts, echo_only, self._first_token_text) if req.echo else None
        rid = f"cmpl-{self._next_id()}"
        lora_id = self._lora_id(model)
        imported = await self._kv_in(req, handoff, prompts[0], lora_id) if len(prompts) == 1 else None
        try:
            handle = await self._submit(rid, items, model, lora_id, picked_by)
        except BaseException:
            await self._kv_release(imported)
            raise
        meta = ResponseMeta(rid, int(time.time()), model, req.n, [len(p) for p in prompts])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamResult(
                self._stream_completion(
                    handle, meta, include_usage, req.logprobs is not None, echo, receive, scoring
                ),
                self._closer(handle, imported),
            )
        try:
            finals = await _collect(handle, receive)
        finally:
            await self._kv_release(imported)
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
            "id": rid,
            "object": "text_completion",
            "created": meta.created,
            "model": model,
            "choices": choices,
            "usage": meta.usage(finals),
        }
        if produce and self.kv is not None:
            body["kv_transfer_params"] = await self.kv.pin_for_pull(prompts[0], lora_id)
        return body

    def _stream_completion(
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

        return _sse_stream(handle, meta, "text_completion", include_usage, receive, choice)

    # ---- chat completions ------------------------------------------------------------------
    async def chat(
        self,
        req: ChatCompletionRequest,
        receive: Receive,
        picked_by: str | None = None,
        handoff: Handoff | None = None,
    ) -> dict[str, Any] | StreamResult:
        model = self.check_model(req.model)
        self._reject_unsupported(req)
        produce = self._produces(req)
        tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_options)
        structured = await self._structured(req, tool_plan.json_schema())
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("logprobs must be true when top_logprobs is set.", "top_logprobs")
        _check_prompt_logprobs(req)
        ids = await self.chat_prompt_ids(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.chat_template,
            req.tools,
        )
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._check_prompt(ids, requested, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        items = [(ids, p) for p in self._params(req, max_tokens, logprobs, req.prompt_logprobs, structured)]
        rid = f"chatcmpl-{self._next_id()}"
        lora_id = self._lora_id(model)
        imported = await self._kv_in(req, handoff, ids, lora_id)
        try:
            handle = await self._submit(rid, items, model, lora_id, picked_by)
        except BaseException:
            await self._kv_release(imported)
            raise
        meta = ResponseMeta(rid, int(time.time()), model, req.n, [len(ids)])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamResult(
                self._stream_chat(handle, meta, include_usage, req.logprobs, receive, tool_plan),
                self._closer(handle, imported),
            )
        try:
            finals = await _collect(handle, receive)
        finally:
            await self._kv_release(imported)
        choices = []
        for index in range(len(items)):
            out = finals[index]
            message, finish_reason = self._tool_message(tool_plan, out)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": {"content": chat_logprobs(out.logprobs or [])} if req.logprobs else None,
                    "finish_reason": finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": meta.created,
            "model": model,
            "choices": choices,
            "usage": meta.usage(finals),
        }
        if req.prompt_logprobs is not None:  # vLLM: on the response, not per choice (one prompt)
            body["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs or [])
        if produce and self.kv is not None:
            body["kv_transfer_params"] = await self.kv.pin_for_pull(ids, lora_id)
        return body

    # -- prefill/decode disaggregation -------------------------------------------------------
    def _produces(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        """A prefill for a decode engine (vLLM's do_remote_decode): answered with the
        kv_transfer_params to pull its blocks with. Only on a producer; elsewhere ignored."""
        params = req.kv_transfer_params
        if params is None or not params.do_remote_decode or self.kv is None or not self.kv.settings.produces:
            return False
        if req.stream:
            raise bad_request("kv_transfer_params.do_remote_decode needs stream false.", "kv_transfer_params")
        return True

    async def _kv_in(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        handoff: Handoff | None,
        prompt_ids: list[int],
        lora_id: int | None,
    ) -> Imported | None:
        """A consumer's hand-off, before the request is queued: the prompt's KV pulled from a
        producer into this engine's prefix cache (None: none, or it failed: computed here)."""
        kv = self.kv
        if kv is None or not kv.settings.consumes:
            return None
        auth = handoff.authorization if handoff else None
        params = req.kv_transfer_params
        if params is not None and params.do_remote_prefill:
            got = await kv.pull(params.model_dump(), prompt_ids, lora_id, auth)
        elif handoff is not None and handoff.prefiller:
            try:
                body = json.loads(handoff.raw_body)
            except ValueError:
                return None
            got = await kv.prefill_remotely(handoff.prefiller, handoff.path, body, prompt_ids, lora_id, auth)
        else:
            return None
        metrics = kv.metrics
        with metrics.lock:
            metrics.external_queries.inc(len(prompt_ids))
            metrics.external_hits.inc(got.tokens if got else 0)
            metrics.touch()
        return got

    async def _kv_release(self, imported: Imported | None) -> None:
        if imported is not None and self.kv is not None:
            await self.kv.release(imported)

    def _closer(self, handle: RequestHandle, imported: Imported | None) -> Callable[[], None]:
        """A stream's close: the request's, then (off the caller's stack) the pulled blocks'."""
        if imported is None:
            return handle.close

        def close() -> None:
            handle.close()
            asyncio.get_running_loop().create_task(self._kv_release(imported))

        return close

    def _tool_message(self, plan: ToolPlan, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish_reason: tool calls read out of its text when
        the request asked for them (OpenAI: finish_reason "tool_calls", except for a named
        function, which finishes "stop")."""
        parser = plan.parser(self.tool_options)
        calls = parser.parse(out.text, final=True) if parser is not None else None
        if calls is None or not calls.calls:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        found = calls.calls if plan.parallel else calls.calls[:1]
        message = {
            "role": "assistant",
            "content": calls.content or None,
            "tool_calls": message_tool_calls(found),
        }
        return message, _tool_finish_reason(plan, out.finish_reason)

    def _stream_chat(
        self,
        handle: RequestHandle,
        meta: ResponseMeta,
        include_usage: bool,
        want_logprobs: bool,
        receive: Receive,
        tool_plan: ToolPlan | None = None,
    ) -> AsyncGenerator[bytes, None]:
        streamers: dict[int, ToolStreamer] = {}  # per choice, when tool calls are parsed

        def tool_delta(index: int, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
            assert tool_plan is not None
            streamer = streamers.get(index)
            if streamer is None:
                parser = tool_plan.parser(self.tool_options)
                assert parser is not None
                streamer = streamers[index] = ToolStreamer(
                    parser, max_calls=None if tool_plan.parallel else 1
                )
            delta = streamer.delta(out.text, final=out.finished)
            finish: str | None = out.finish_reason
            if out.finished and streamer.called:
                finish = _tool_finish_reason(tool_plan, finish)
            return delta, finish

        parse_tools = tool_plan is not None and tool_plan.parser(self.tool_options) is not None

        def choice(index: int, out: RequestOutput) -> dict[str, Any] | None:
            lp = None
            if want_logprobs and out.new_logprobs:
                lp = {"content": chat_logprobs(out.new_logprobs)}
            if parse_tools:
                delta, finish_reason = tool_delta(index, out)
            else:
                delta = {"content": out.delta_text} if out.delta_text else {}
                finish_reason = out.finish_reason
            if not delta and not out.finished and lp is None:
                return None
            c: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish_reason if out.finished else None,
            }
            if out.finished:
                c["stop_reason"] = out.stop_reason
            return c

        # The role arrives first, like OpenAI, so clients can render a bubble before any token.
        roles = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(handle.ids))
        ]
        return _sse_stream(handle, meta, "chat.completion.chunk", include_usage, receive, choice, roles)


def _tool_finish_reason(plan: ToolPlan, finish_reason: str | None) -> str | None:
    if plan.mode == "named" or finish_reason != "stop":
        return finish_reason
    return "tool_calls"


async def _sse_stream(
    handle: RequestHandle,
    meta: ResponseMeta,
    obj: str,
    include_usage: bool,
    receive: Receive,
    choice: Callable[[int, RequestOutput], dict[str, Any] | None],
    first: list[dict[str, Any]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE body of both endpoints: the `first` choices (chat: the role), then one chunk per
    choice `choice` makes of an engine output (None: nothing to send), one write per engine step;
    then the usage chunk (stream_options.include_usage) and [DONE]. An engine that stops mid-stream
    ends the body with an error event; a client that leaves ends it silently; the request is
    aborted on every way out."""
    base = {"id": meta.rid, "object": obj, "created": meta.created, "model": meta.model}
    finals: dict[int, RequestOutput] = {}
    watcher = asyncio.ensure_future(watch_disconnect(receive, handle))

    def chunk(c: dict[str, Any]) -> bytes:
        body = {**base, "choices": [c]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        if first:
            yield b"".join(chunk(c) for c in first)
        while not handle.done:
            parts = []
            for index, out in await _next_batch(handle):
                if out.finished:
                    finals[index] = out
                c = choice(index, out)
                if c is not None:
                    parts.append(chunk(c))
            if parts:
                yield b"".join(parts)
        if include_usage:
            yield sse({**base, "choices": [], "usage": meta.usage(finals)})
        yield SSE_DONE
    except EngineDeadError as exc:
        yield sse(stream_error(exc.status, f"{exc} Retry on another replica."))
    except ClientGone:
        pass
    finally:
        watcher.cancel()
        handle.close()


async def _next_batch(handle: RequestHandle) -> list[tuple[int, RequestOutput]]:
    """Everything already queued, at least one item: one socket write per engine step, not per choice."""
    batch = [await handle.next()]
    while not handle.queue.empty():
        batch.append(await handle.next())
    return batch


async def _collect(handle: RequestHandle, receive: Receive) -> dict[int, RequestOutput]:
    watcher = asyncio.ensure_future(watch_disconnect(receive, handle))
    finals: dict[int, RequestOutput] = {}
    prompt_lps: dict[int, list[PromptTokenLogprobs | None]] = {}
    try:
        while not handle.done:
            index, out = await handle.next()
            if out.prompt_logprobs is not None:  # only the first output carries them
                prompt_lps[index] = out.prompt_logprobs
            if out.finished:
                if out.prompt_logprobs is None and index in prompt_lps:
                    out.prompt_logprobs = prompt_lps[index]
                finals[index] = out
    except EngineDeadError as exc:
        raise APIError(exc.status, f"{exc} Retry on another replica.", code="engine_stopped") from None
    except ClientGone:
        raise APIError(499, "Client closed the request.") from None
    finally:
        watcher.cancel()
        handle.close()
    return finals


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    # vLLM's rule: the streamed bodies have no place for them.
    if req.stream and req.prompt_logprobs:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


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

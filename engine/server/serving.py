"""The shared base of the OpenAI endpoints on top of `AsyncEngine` (split the way vLLM splits its
serving files: completions in `serving_completion.py`, chat in `serving_chat.py`, the
prefill/decode hand-off in `pd_handoff.py`).

`OpenAIServing` holds what both endpoints (and /tokenize, /detokenize) share: the model check and
the request prologue, prompt validation and tokenization, one `SamplingParams` per choice (n > 1
fans out into n engine requests with seeds seed, seed+1, ...), and queuing on the engine. The
module also holds the two ways a queued request is answered: its finished choices collected
(non-streaming) or an SSE body yielding chunks as the engine produces tokens. Response bodies are
plain dicts serialized with `json.dumps`, which keeps per-token overhead small.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from kvgate.api.contracts.admissions import Pick
from kvgate.api.contracts.queue_order import QueueOrder
from kvgate.api.lora import lora_int_id
from kvgate.api.tracing import NO_SPAN, Span
from kvgate.engine.outputs import PromptTokenLogprobs, RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.async_engine import AsyncEngine, EngineDeadError, RequestHandle
from kvgate.engine.server.errors import APIError, bad_request
from kvgate.engine.server.pd_handoff import Handoff, PDHandoff
from kvgate.engine.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvgate.engine.server.responses import SSE_DONE, ResponseMeta, sse, stream_error
from kvgate.engine.server.tools.request import ToolOptions
from kvgate.engine.structured import StructuredOutputError, StructuredOutputSpec

if TYPE_CHECKING:
    from kvgate.engine.server.kv_transfer_http import Imported, KVTransfer

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


class OpenAIServing:
    """What the OpenAI endpoints share, over one engine and its tokenizer and served model."""

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
        self.pd = PDHandoff(kv_transfer)
        self.tokenizer = tokenizer
        self.model = model
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_options = tool_options or ToolOptions()
        # the waiting order (a body priority with fcfs is refused, as vLLM does)
        config = getattr(getattr(engine, "engine", None), "config", None)
        self.scheduling_policy: str = getattr(config, "scheduling_policy", "fair")
        # Unique ids without a getrandom syscall per request (a GIL hand-off while the engine
        # thread is busy): a random per-process prefix plus a counter.
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()

    def first_token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):08x}"

    def _lora_id(self, model: str) -> int | None:
        # the adapter's stable id keys its prefix-cache blocks and KV events (the EPP hashes alike)
        if model in self.model.adapters or model in self.model.retiring:
            return lora_int_id(model)
        return None

    # ---- validation shared by both endpoints ----------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model.served_names:
            return self.model.name
        if name in self.model.adapters or name in self.model.retiring:
            return name
        raise _unknown_model(name)

    def reject_unsupported(self, req: CompletionRequest | ChatCompletionRequest) -> None:
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
        if req.priority and self.scheduling_policy == "fcfs":
            # vLLM's answer: a priority the queue would ignore is refused, not dropped
            raise bad_request(
                "priority is not used with --scheduling-policy fcfs; omit it or run the engine "
                "with --scheduling-policy priority or fair.",
                "priority",
            )

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int | None:
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

    def sampling_params(
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

    async def structured_outputs(
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

    # ---- the request's way through the engine, shared by both endpoints ---------------------
    def prologue(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[str, bool]:
        """What every generation request checks first, in this order (the first that fails is
        the error): the model it names, the options this engine refuses, a P/D producer's
        do_remote_decode. Returns the model to answer as, and whether the answer carries
        kv_transfer_params (`Submitted.pin_for_pull`)."""
        model = self.check_model(req.model)
        self.reject_unsupported(req)
        return model, self.pd.produces(req)

    async def submit(
        self,
        id_prefix: str,
        req: CompletionRequest | ChatCompletionRequest,
        model: str,
        prompts: list[list[int]],
        items: list[tuple[list[int], SamplingParams]],
        handoff: Handoff | None,
        pick: Pick | None,
        order: QueueOrder | None = None,
        span: Span = NO_SPAN,
    ) -> Submitted:
        """Queue a request's sequences (`items`, from `prompts`) on the engine under a new id.
        A P/D consumer pulls a single prompt's KV first; the pulled blocks go if queuing fails."""
        rid = f"{id_prefix}-{self._next_id()}"
        lora_id = self._lora_id(model)
        imported = await self.pd.pull_in(req, handoff, prompts[0], lora_id) if len(prompts) == 1 else None
        try:
            handle = await self.engine.submit(
                rid, items, lora_id=lora_id, pick=pick, order=order or QueueOrder(req.priority)
            )
        except BaseException as exc:
            await self.pd.release(imported)
            if isinstance(exc, APIError) and exc.code == "model_not_found":
                # its adapter went between check_model and the engine
                raise _unknown_model(model) from None
            raise
        meta = ResponseMeta(rid, int(time.time()), model, req.n, [len(p) for p in prompts], span)
        return Submitted(handle, meta, lora_id, imported, self.pd)


@dataclass
class Submitted:
    """A request queued on the engine, to answer either way: `stream` or `collect`."""

    handle: RequestHandle
    meta: ResponseMeta
    lora_id: int | None
    imported: Imported | None  # the KV a P/D consumer pulled for it, released when it ends
    pd: PDHandoff

    def stream(self, body: AsyncGenerator[bytes, None]) -> StreamResult:
        return StreamResult(body, self.pd.closer(self.handle, self.imported))

    async def collect(self, receive: Receive) -> dict[int, RequestOutput]:
        """Every choice's final output, by index."""
        try:
            finals = await _collect(self.handle, receive)
            self.meta.trace_finals(finals)
            return finals
        finally:
            await self.pd.release(self.imported)

    async def pin_for_pull(self, prompt_ids: list[int]) -> dict[str, Any]:
        """A P/D producer's kv_transfer_params: the prompt's blocks pinned for the decoder."""
        return await self.pd.pin_for_pull(prompt_ids, self.lora_id)


def include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """stream_options.include_usage: a usage chunk ends the stream."""
    return bool(req.stream_options and req.stream_options.include_usage)


def check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    # vLLM's rule: the streamed bodies have no place for them.
    if req.stream and req.prompt_logprobs:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


async def sse_stream(
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
        meta.trace_finals(finals)
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

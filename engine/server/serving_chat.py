"""The OpenAI chat completions endpoint (POST /v1/chat/completions) over the shared `OpenAIServing`.

What only chat has: messages rendered through the chat template, tools (a required or named
tool_choice constrains decoding; tool calls parsed out of the text, whole or as they stream),
the role chunk first, and the chat.completion body and chunks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from kvgate.api.contracts.admissions import Pick
from kvgate.api.contracts.queue_order import QueueOrder
from kvgate.api.tracing import NO_SPAN, Span
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.server.async_engine import RequestHandle
from kvgate.engine.server.errors import bad_request
from kvgate.engine.server.pd_handoff import Handoff
from kvgate.engine.server.protocol import ChatCompletionRequest
from kvgate.engine.server.responses import ResponseMeta, chat_logprobs, prompt_logprobs_json
from kvgate.engine.server.serving import (
    OpenAIServing,
    Receive,
    StreamResult,
    check_prompt_logprobs,
    include_usage,
    sse_stream,
)
from kvgate.engine.server.tools.request import ToolPlan, plan_tools
from kvgate.engine.server.tools.stream import ToolStreamer, message_tool_calls


class OpenAIServingChat:
    """POST /v1/chat/completions."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def chat(
        self,
        req: ChatCompletionRequest,
        receive: Receive,
        pick: Pick | None = None,
        handoff: Handoff | None = None,
        order: QueueOrder | None = None,
        span: Span = NO_SPAN,
    ) -> dict[str, Any] | StreamResult:
        serving = self.serving
        model, produce = serving.prologue(req)
        tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, serving.tool_options)
        structured = await serving.structured_outputs(req, tool_plan.json_schema())
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("logprobs must be true when top_logprobs is set.", "top_logprobs")
        check_prompt_logprobs(req)
        ids = await serving.chat_prompt_ids(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.chat_template,
            req.tools,
        )
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = serving.check_prompt(ids, requested, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = serving.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, structured)
        items = [(ids, p) for p in params]
        sub = await serving.submit("chatcmpl", req, model, [ids], items, handoff, pick, order, span)
        if req.stream:
            return sub.stream(
                self._stream(sub.handle, sub.meta, include_usage(req), req.logprobs, receive, tool_plan)
            )
        finals = await sub.collect(receive)
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
            "id": sub.meta.rid,
            "object": "chat.completion",
            "created": sub.meta.created,
            "model": model,
            "choices": choices,
            "usage": sub.meta.usage(finals),
        }
        if req.prompt_logprobs is not None:  # vLLM: on the response, not per choice (one prompt)
            body["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs or [])
        if produce:
            body["kv_transfer_params"] = await sub.pin_for_pull(ids)
        return body

    def _tool_message(self, plan: ToolPlan, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish_reason: tool calls read out of its text when
        the request asked for them (OpenAI: finish_reason "tool_calls", except for a named
        function, which finishes "stop")."""
        parser = plan.parser(self.serving.tool_options)
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

    def _stream(
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
                parser = tool_plan.parser(self.serving.tool_options)
                assert parser is not None
                streamer = streamers[index] = ToolStreamer(
                    parser, max_calls=None if tool_plan.parallel else 1
                )
            delta = streamer.delta(out.text, final=out.finished)
            finish: str | None = out.finish_reason
            if out.finished and streamer.called:
                finish = _tool_finish_reason(tool_plan, finish)
            return delta, finish

        parse_tools = tool_plan is not None and tool_plan.parser(self.serving.tool_options) is not None

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
        return sse_stream(handle, meta, "chat.completion.chunk", include_usage, receive, choice, roles)


def _tool_finish_reason(plan: ToolPlan, finish_reason: str | None) -> str | None:
    if plan.mode == "named" or finish_reason != "stop":
        return finish_reason
    return "tool_calls"
